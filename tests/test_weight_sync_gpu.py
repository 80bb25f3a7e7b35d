"""CUDA: a trainer process pushes its weights into `samebits serve --device cuda` on the same GPU
by CUDA IPC handles (a list of tensors, or slime's flattened bucket), and through a gloo group
from CUDA tensors; completions then equal the
trainer's own line on CUDA, bit for bit. (NCCL needs two GPUs: not run here.)"""

from __future__ import annotations

import socket

import pytest
import torch
from serve_server import Server
from test_weight_sync import _slime_bucket

from samebits import batch_invariant, trainer
from samebits.client import Client

pytestmark = pytest.mark.gpu

PROMPT = [5, 9, 11, 3, 7, 2, 8]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sync", ["tensor", "bucket", "distributed"])
def test_cuda_push_then_completions_equal_the_trainer_line(tiny, sync, monkeypatch):
    server = Server(tiny, "--device", "cuda", "--max-num-seqs", "4", "--max-model-len", "128")
    try:
        client = Client(server.url, timeout=300)
        model = trainer.load_hf_model(tiny, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.75)  # weights the server does not have
        before = client.weight_digests(kind="fast")
        if sync == "tensor":
            client.update_weights_from_tensor(model.named_parameters())
        elif sync == "bucket":  # slime's colocated sync: one CUDA flattened bucket by IPC handle
            payload, alive = _slime_bucket(client.prepare(model.named_parameters()), monkeypatch)
            body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket"}
            assert "updated" in client.post("/update_weights_from_tensor", body)["message"]
            del alive
        else:
            client.init_weights_update_group("127.0.0.1", _port(), backend="gloo")
            client.update_weights_from_distributed(model.named_parameters())
        after = client.weight_digests(kind="fast")
        assert after == client.local_digests(model.named_parameters(), kind="fast") != before
        for i, t in enumerate((0.7, 1.0, 1.3)):
            sp = {"temperature": t, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": i}
            answer = client.generate(PROMPT, sp)
            ids = torch.tensor(PROMPT + answer["output_ids"], device="cuda")
            with batch_invariant(), torch.no_grad():
                logits = model(input_ids=ids[None], use_cache=False).logits[0]
                want = torch.log_softmax(logits[len(PROMPT) - 1 : -1].float() / t, dim=-1)
            want = want.gather(-1, ids[len(PROMPT) :, None])[:, 0].cpu()
            got = torch.tensor([x[0] for x in answer["meta_info"]["output_token_logprobs"]])
            assert torch.equal(got, want), t
    finally:
        server.stop()
