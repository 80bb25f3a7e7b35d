"""The two traps of timing through `generate` that `samebits bench` must avoid (issue 45), on
the tiny model on the CPU, with no timing: a spy records every call `measure_generate` makes
(warm-up or timed, its shape) and the tokens the engine computed in it.

- Triton JIT: the first call at a new shape compiles the prefill kernels, so each timed call
  must follow an untimed call of the same shape (batch, prompt length, max_tokens).
- Prefix caching: a repeated prompt skips its prefill, so every timed call must compute all
  of its prompt tokens.
Each detector has a negative control: with the trap let in, the detector reports it."""

from __future__ import annotations

import pytest
import torch

from samebits.bench import generate as bench_generate
from samebits.engine.llm import LLM

BATCH, CONTEXT = 3, 24


def _spy(llm, monkeypatch) -> list[dict]:
    """Every call measure_generate makes, in order: kind (warm / timed), its shape, and the
    tokens the runner computed during it (prefill chunks and decode rows)."""
    calls, computed = [], [0]
    launch = llm.runner.launch

    def counting(batch, reqs, ahead=None):
        computed[0] += sum(c.num_tokens for c in batch.chunks)
        return launch(batch, reqs, ahead)

    monkeypatch.setattr(llm.runner, "launch", counting)

    def wrap(kind, fn):
        def spy(llm_, prompts, max_tokens, seed=0):
            before = computed[0]
            out = fn(llm_, prompts, max_tokens, seed=seed)
            shape = (len(prompts), len(prompts[0]), max_tokens)
            calls.append({"kind": kind, "shape": shape, "computed": computed[0] - before})
            return out

        return spy

    for name, kind in (("warm_generate", "warm"), ("timed_generate", "timed"), ("timed_decode_steps", "timed")):
        monkeypatch.setattr(bench_generate, name, wrap(kind, getattr(bench_generate, name)))
    return calls


def unwarmed(calls: list[dict]) -> list[tuple]:
    """Shapes of timed calls that no earlier warm-up call of the same shape preceded."""
    warmed, bad = set(), []
    for c in calls:
        if c["kind"] == "warm":
            warmed.add(c["shape"])
        elif c["shape"] not in warmed:
            bad.append(c["shape"])
    return bad


def short_prefill(calls: list[dict]) -> list[tuple]:
    """Timed calls that computed fewer tokens than their full prefill and decode need:
    B x prompt tokens, plus B x (max_tokens - 1) decode rows."""
    return [
        (c["shape"], c["computed"])
        for c in calls
        if c["kind"] == "timed" and c["computed"] < c["shape"][0] * (c["shape"][1] + c["shape"][2] - 1)
    ]


def _llm(tiny, prefix_caching: bool) -> LLM:
    return LLM(tiny, device="cpu", max_num_seqs=4, max_model_len=96, enable_prefix_caching=prefix_caching)


def _measure(llm, monkeypatch, **kw) -> list[dict]:
    calls = _spy(llm, monkeypatch)
    bench_generate.measure_generate(llm, BATCH, CONTEXT, extra=4, **kw)
    return calls


def test_timed_calls_are_warmed_at_their_shape(tiny, monkeypatch):
    calls = _measure(_llm(tiny, False), monkeypatch)
    timed = [c["shape"] for c in calls if c["kind"] == "timed"]
    assert len(timed) == 3 and {s[2] for s in timed} >= {1}  # the 1-new and the N-new calls
    assert unwarmed(calls) == []
    assert calls[0]["kind"] == "warm"


def test_warm_up_detector_catches_a_bench_without_warm_up(tiny, monkeypatch):
    calls = _measure(_llm(tiny, False), monkeypatch, warm=False)  # the trap let in
    assert len(unwarmed(calls)) == 3


def test_timed_calls_compute_their_full_prefill(tiny, monkeypatch):
    calls = _measure(_llm(tiny, False), monkeypatch)
    assert [c for c in calls if c["kind"] == "timed"] and short_prefill(calls) == []


def test_prefill_detector_catches_repeated_prompts_with_prefix_caching_on(tiny, monkeypatch):
    """The trap let in: every call gets the same prompts, the engine shares prefixes. The
    detector sees the skipped prefill, and measure_generate refuses the result itself."""
    same = bench_generate.random_prompts

    monkeypatch.setattr(
        bench_generate, "random_prompts", lambda v, n, length, seed, banned=(): same(v, n, length, 0, banned)
    )
    llm = _llm(tiny, True)
    calls = _spy(llm, monkeypatch)
    with pytest.raises(RuntimeError, match="prefix cache"):
        bench_generate.measure_generate(llm, BATCH, CONTEXT, extra=4)
    assert short_prefill(calls)  # the timed calls that ran before the refusal skipped prefill


def test_floors_at_the_qwen3_30b_a3b_shape_are_the_documented_ones():
    """docs/speed-measurements.md's arithmetic: 48 layers, 1024 tokens of context."""
    from transformers import Qwen3MoeConfig

    from samebits.bench import core
    from samebits.model.qwen3_moe.config import ModelConfig

    cfg = ModelConfig.from_dict(Qwen3MoeConfig(num_hidden_layers=48, **core.QWEN3_30B_A3B).to_dict())
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert core.step_bytes(cfg, 1, 1024) == 2 * (
        48 * (18_874_368 + 8 * 4_718_592 + 262_144 + 1_048_576) + 151936 * 2048 + 2048
    )
    assert core.floors(cfg, 1, 1024, h100)[0] == pytest.approx(1.846, abs=1e-3)
    assert core.floors(cfg, 64, 1024, h100)[0] == pytest.approx(19.687, abs=1e-3)
    assert core.floors(cfg, 96, 1024, h100)[0] == pytest.approx(20.892, abs=1e-3)
    assert core.floors(cfg, 256, 1024, h200)[0] == pytest.approx(17.961, abs=1e-3)
    assert core.prefill_flops_per_token(cfg, 1024) == 48 * (
        2 * (18_874_368 + 37_748_736 + 262_144) + 16384 * 512.5
    )
    assert core.floors(cfg, 64, 1024, h100)[1] == pytest.approx(134_720, abs=1)
    assert core.floors(cfg, 1, 1024, "cpu")[0] is None  # no nominal bandwidth: no decode floor stated


def test_bench_prompts_never_hold_a_familys_placeholder_ids():
    """The bench's random prompts leave out `family.never_sample` (the Omni thinker's image,
    video and audio placeholders: a text prompt holding one is refused by the engine). Control:
    the same draw with nothing banned holds them; with nothing banned the draw is randint's."""
    banned = (3, 7, 11)
    got = torch.tensor(bench_generate.random_prompts(16, 8, 64, seed=0, banned=banned))
    assert not torch.isin(got, torch.tensor(banned)).any()
    assert set(got.unique().tolist()) == set(range(16)) - set(banned)
    plain = torch.tensor(bench_generate.random_prompts(16, 8, 64, seed=0))
    assert torch.isin(plain, torch.tensor(banned)).any()
    assert torch.equal(plain, torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(0)))
