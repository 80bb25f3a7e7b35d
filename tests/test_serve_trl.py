"""TRL's own `VLLMClient` (trl.generation.vllm_client, TRL 1.16.0) driving `samebits serve` over
loopback, with the calls and keyword arguments GRPOTrainer(use_vllm=True, vllm_mode="server")
makes. The server is a subprocess on 127.0.0.1, stopped by its PID.

vLLM is not installed here (it cannot be, on the CPU CI), and VLLMClient refuses to construct
without it: the `client` fixture patches ONLY TRL's vllm-installed check
(`trl.generation.vllm_client.is_vllm_available`, while the constructor runs). Every request
below is TRL's own code.

Claims: the log-probs VLLMClient.generate and .chat return (JSON numbers read back as float32)
equal the HF trainer's recompute under `batch_invariant()` bit for bit, for token-id prompts
with n=2, temperature, top_p=1, top_k=0 (off), min_p=0, repetition_penalty=1, logprobs=0;
`logprob_formula` in generation_kwargs reports TRL's own line, on the same tokens;
`get_sequence_logprobs` (TRL's teacher scoring, `prompt_logprobs`) reads the trainer's recompute
of the sequence at the temperature sent, and the default row's top 3, bit for bit;
get_world_size, get_server_info and reset_prefix_cache answer as vLLM's dev endpoints do;
what is not supported is refused with a message naming the field. Controls: the recompute at
another temperature, or with the stock grouped_mm experts, differs; the default line differs
from TRL's on the same tokens.

Not run: weight sync through VLLMClient (init_communicator, update_named_params) needs vLLM's
NCCL (PyNccl) on CUDA on the trainer's side; here, on a CPU engine, /init_weight_transfer_engine
is refused naming CUDA, and the start/finish bracket answers as vLLM's (checked below; the
receiving path is tests/test_vllm_weight_transfer.py's).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from serve_server import Server

from samebits import batch_invariant, trainer
from samebits.numerics import logprob_formulas as lf
from samebits.requests.sampling_params import LOGPROB_FORMULAS

vllm_client = pytest.importorskip("trl.generation.vllm_client")
pytest.importorskip("requests", reason="VLLMClient sends with requests (TRL's vllm extra installs it)")

T = 0.7  # a temperature the values depend on (GRPOConfig's default is 1.0)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def grpo_kwargs(**generation_kwargs) -> dict:
    """What GRPOTrainer's vLLM generation passes to VLLMClient.generate (trl/generation/
    vllm_generation.py), with a seed so the server's samples replay."""
    return dict(
        n=2,
        repetition_penalty=1.0,
        temperature=T,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=10,
        logprobs=0,
        structured_outputs_regex=None,
        generation_kwargs={"seed": 1234, "ignore_eos": True} | generation_kwargs,
    )


@pytest.fixture(scope="module")
def server(ckpt):
    # as `trl vllm-serve` starts vLLM: the distribution the token was drawn from
    srv = Server(ckpt, "--max-num-seqs", "8", "--max-model-len", "256", "--logprobs-mode", "processed_logprobs")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)  # the one patch
        return vllm_client.VLLMClient(base_url=server.url, connection_timeout=60)


@pytest.fixture(scope="module")
def hf(ckpt):
    return trainer.load_hf_model(ckpt, device="cpu", dtype=torch.bfloat16)


def _sampled(out: dict) -> list[torch.Tensor]:
    """The sampled token's log-prob of each sequence, from VLLMClient's [seq][pos][rank] lists."""
    for ids, ranked in zip(out["completion_ids"], out["logprob_token_ids"], strict=True):
        assert ranked == [[t] for t in ids]  # logprobs=0: the sampled token alone
    return [torch.tensor([row[0] for row in seq], dtype=torch.float32) for seq in out["logprobs"]]


def _recompute(model, prompt_ids, completion_ids, temperature: float) -> list[torch.Tensor]:
    seqs = [p + c for p, c in zip(prompt_ids, completion_ids, strict=True)]
    with batch_invariant():
        lens = [len(p) for p in prompt_ids]
        lps = trainer.token_logprobs(model, seqs, lens, packed=True, temperature=temperature)
    return [lp.cpu() for lp in lps]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_grpo_generate_logprobs_equal_the_trainer_recompute_bitwise(client, ckpt, hf):
    out = client.generate(prompts=PROMPTS, **grpo_kwargs())
    assert out["prompt_ids"] == PROMPTS
    prompts = [p for p in PROMPTS for _ in range(2)]  # prompt-major, as GRPOTrainer expands them
    assert [len(c) for c in out["completion_ids"]] == [10] * 6
    assert all(out["completion_ids"][i] != out["completion_ids"][i + 1] for i in range(0, 6, 2))
    got = _sampled(out)
    assert _equal(got, _recompute(hf, prompts, out["completion_ids"], T))
    assert client.generate(prompts=PROMPTS, **grpo_kwargs()) == out  # the seed replays
    # controls: the values depend on the temperature sent, and on the experts' kernel
    assert not _equal(got, _recompute(hf, prompts, out["completion_ids"], 1.0))
    stock = trainer.load_hf_model(ckpt, device="cpu", dtype=torch.bfloat16, experts_implementation="grouped_mm")
    assert not _equal(got, _recompute(stock, prompts, out["completion_ids"], T))


def test_grpo_chat_logprobs_equal_the_trainer_recompute_bitwise(client, hf):
    messages = [[{"role": "user", "content": "hello there"}], [{"role": "user", "content": "count to 3"}]]
    out = client.chat(messages, **grpo_kwargs())
    prompts = [p for p in out["prompt_ids"] for _ in range(2)]
    assert len(out["prompt_ids"]) == 2 and all(out["prompt_ids"])
    got = _sampled(out)
    assert _equal(got, _recompute(hf, prompts, out["completion_ids"], T))
    assert not _equal(got, _recompute(hf, prompts, out["completion_ids"], 1.0))  # control


def test_logprob_formula_trl_reports_trls_line_on_the_same_tokens(client, hf):
    default = client.generate(prompts=PROMPTS, **grpo_kwargs())
    out = client.generate(prompts=PROMPTS, **grpo_kwargs(logprob_formula="trl"))
    assert out["completion_ids"] == default["completion_ids"]  # the formula changes no sample
    prompts = [p for p in PROMPTS for _ in range(2)]
    trl_line, default_line = [], []
    for p, c in zip(prompts, out["completion_ids"], strict=True):
        ids = torch.tensor(p + c)
        with batch_invariant(), torch.no_grad():
            logits = hf(input_ids=ids[None], use_cache=False).logits[0][len(p) - 1 : -1]
            temps = torch.full((len(c),), T, dtype=torch.float32)
            trl_line.append(lf.LINES["trl"](logits, ids[len(p) :], temps))
            default_line.append(lf.LINES["log_softmax"](logits, ids[len(p) :], temps))
    assert _equal(_sampled(out), trl_line)
    assert _equal(_sampled(default), default_line)
    assert not _equal(_sampled(out), default_line)  # control: the field reached the engine


def test_get_sequence_logprobs_scores_the_sequence_as_the_trainer_recomputes_it(client, hf):
    """TRL's teacher scoring (`VLLMClient.get_sequence_logprobs`, what ServerDistillationTrainer
    calls): `prompt_logprobs` over prompt + completion, at the temperature sent."""
    seqs = [p + [20 + i, 21, 22 + i, 23] for i, p in enumerate(PROMPTS)]
    lens = [len(p) for p in PROMPTS]
    out = client.get_sequence_logprobs(sequences=seqs, prompt_lengths=lens, top_logprobs=3, temperature=T)
    actual = [torch.tensor([v[0] for v in seq], dtype=torch.float32) for seq in out["actual_logprobs"]]
    completions = [s[n:] for s, n in zip(seqs, lens, strict=True)]
    assert out["actual_token_ids"] == [[[t] for t in c] for c in completions]
    assert _equal(actual, _recompute(hf, PROMPTS, completions, T))
    assert not _equal(actual, _recompute(hf, PROMPTS, completions, 1.0))  # control: T reached the values
    for seq, n, ids, values in zip(seqs, lens, out["logprob_token_ids"], out["logprobs"], strict=True):
        with batch_invariant(), torch.no_grad():
            logits = hf(input_ids=torch.tensor(seq)[None], use_cache=False).logits[0][n - 1 : -1]
            row = torch.log_softmax(logits.float() / T, dim=-1)  # the default line, its ranking
        top = torch.sort(row, dim=-1, descending=True, stable=True)
        assert ids == top.indices[:, :3].tolist()  # TRL sorts by the reported rank
        assert torch.equal(torch.tensor(values, dtype=torch.float32), top.values[:, :3])


def test_dev_endpoints_answer_as_vllms(client, server):
    assert client.get_world_size() == 1
    info = client.get_server_info()  # vllm_config, as init_communicator and GRPOTrainer read it
    assert info["weight_transfer_config"] is not None
    assert info["weight_transfer_config"]["backend"] == "sglang"
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["model_config"]["max_model_len"] == 256  # --max-model-len, as started
    assert info["model_config"]["served_model_name"] == server.model
    assert info["scheduler_config"]["max_num_seqs"] == 8
    assert client.reset_prefix_cache() is None
    r = httpx.post(f"{server.url}/reset_prefix_cache", timeout=60)
    assert r.status_code == 200 and r.json()["success"] is True
    text = httpx.get(f"{server.url}/server_info", timeout=60).json()
    assert isinstance(text["vllm_config"], str)
    # beside vLLM's keys, SGLang's (its /server_info): started without --enable-memory-saver
    assert text["enable_memory_saver"] is False and text["context_length"] == 256


def test_vllm_weight_transfer_on_a_cpu_engine_is_refused_naming_cuda(client, server):
    # what init_communicator posts (TRL 1.16 with vLLM >= 0.28); on a CUDA engine it would join
    init_info = {"master_address": "127.0.0.1", "master_port": 51216, "rank_offset": 1, "world_size": 2}
    r = httpx.post(
        f"{server.url}/init_weight_transfer_engine", json={"init_info": init_info | {"packed": True}}
    )
    assert r.status_code == 400 and "CUDA" in r.json()["error"]["message"]
    # weight_update()'s bracket, TRL's own code: start, then finish (nothing received or applied);
    # it raises on any answer but 200
    with client.weight_update():
        r = httpx.post(f"{server.url}/start_weight_update", json={})
        assert r.status_code == 400 and "already open" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/finish_weight_update", json={})
    assert r.status_code == 400 and "no update is open" in r.json()["error"]["message"]  # it was closed
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"min_p": 0.1}, "min_p"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"structured_outputs_regex": "a+"}, "structured_outputs"),
        ({"generation_kwargs": {"logprob_formula": "nope"}}, "logprob_formula"),
    ],
)
def test_what_is_not_supported_is_a_400_naming_the_field(client, kwargs, field):
    with pytest.raises(Exception, match="Request failed: 400") as e:
        client.generate(prompts=PROMPTS[:1], **(grpo_kwargs() | kwargs))
    assert f'"param":"{field}"' in str(e.value).replace(" ", "")
    if field == "logprob_formula":
        assert all(name in str(e.value) for name in LOGPROB_FORMULAS)
