"""The reported log-prob is the trainer's own line, `torch.log_softmax(logits.float() / T, dim=-1)`
with T a Python float, bit for bit, for every temperature and per-row temperatures in one batch.

The CUDA twin (where the line multiplies by the float32 reciprocal) is in test_gpu.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from samebits import LLM, SamplingParams, batch_invariant, trainer
from samebits.numerics.ops import reported_logprobs

TEMPS = (0.7, 1.0, 1.3, 0.0)  # 0: greedy, reported at T = 1


def _trainer_line(row: torch.Tensor, t: float) -> torch.Tensor:
    """What a trainer writes (verl, OpenRLHF, slime): T a Python float."""
    return torch.log_softmax(row.float() / (t if t > 0 else 1.0), dim=-1)


@pytest.mark.parametrize("invariant", [True, False], ids=["batch_invariant", "stock"])
def test_per_row_temperatures_equal_the_trainer_line_row_by_row(invariant):
    # 8256 columns: past one 8192-column block of the tree sum; bf16 logits as a model gives
    logits = (torch.randn(8, 8256, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    temps = [TEMPS[i % 4] for i in range(8)]
    with batch_invariant() if invariant else contextlib.nullcontext():
        got = reported_logprobs(logits, temps)
        want = torch.cat([_trainer_line(logits[i : i + 1], t) for i, t in enumerate(temps)])
    assert torch.equal(got, want)


def test_control_the_cuda_rounding_of_the_line_differs_on_cpu():
    # The control for the claim above: multiplying by the float32 reciprocal (what the same line
    # does on CUDA) changes bits on the CPU, so the comparison can see the temperature's rounding.
    logits = (torch.randn(8, 8256, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    with batch_invariant():
        for t in (0.7, 1.3):
            recip = torch.log_softmax(logits.float() * (1 / torch.tensor(t, dtype=torch.float32)), dim=-1)
            assert not torch.equal(recip, _trainer_line(logits, t)), t
        one = torch.log_softmax(logits.float() * (1 / torch.tensor(1.0)), dim=-1)
        assert torch.equal(one, _trainer_line(logits, 1.0))  # T = 1 has no rounding to see


def test_engine_log_probs_equal_the_trainer_line_on_the_hf_model(tiny):
    """Four temperatures in one batch; the trainer side is transformers' forward and one line,
    no samebits helper but `batch_invariant()` and the samebits attention/experts it loads.
    (The tiny model's logits are too small for 1 / T's rounding to reach a log-prob; the
    control with teeth is the row test above and the wide model's, in test_wide.py.)"""
    llm = LLM(tiny, device="cpu", dtype="bfloat16", max_num_seqs=4, max_model_len=64)
    prompts = [[5, 9, 11, 3], [8, 6, 4], [3, 3, 3, 7, 2], [10, 12]]
    params = [
        SamplingParams(temperature=t, max_tokens=12, ignore_eos=True, seed=7 + i) for i, t in enumerate(TEMPS)
    ]
    outs = llm.generate(prompts, params)
    model = trainer.load_hf_model(tiny, dtype=torch.bfloat16)
    for out, t in zip(outs, TEMPS, strict=True):
        ids = torch.tensor(out.prompt_token_ids + out.token_ids)
        p = len(out.prompt_token_ids)
        with batch_invariant(), torch.no_grad():
            logits = model(input_ids=ids[None], use_cache=False).logits[0]
            lp = _trainer_line(logits[p - 1 : -1], t).gather(-1, ids[p:, None])[:, 0]
        assert torch.equal(lp, out.logprobs), t
