"""`samebits serve --device cuda`: 16 mixed concurrent clients, log-probs equal to the trainer's
packed recompute on CUDA bit for bit (the Triton kernels on both sides), replay alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from serve_server import Server
from test_serve import _recompute, _run

pytestmark = pytest.mark.gpu


def test_cuda_server_16_mixed_clients_equal_the_trainer_bitwise(ckpt):
    server = Server(ckpt, "--device", "cuda", "--max-num-seqs", "8", "--max-model-len", "256")
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: _run(server, i), range(16)))
        for i, r in enumerate(results):
            assert _run(server, i) == r
        assert server.metric("samebits_kv_blocks_used") == 0
    finally:
        server.stop()
    want = _recompute(ckpt, results, device="cuda")
    for (_, _, lps, _), lp in zip(results, want, strict=True):
        assert torch.equal(torch.tensor(lps, dtype=torch.float32), lp)
    neg = _recompute(ckpt, results, device="cuda", experts_implementation="grouped_mm")
    assert any(not torch.equal(torch.tensor(r[2]), lp) for r, lp in zip(results, neg, strict=True))
