"""CUDA: async scheduling through the CUDA graphs. A step launched ahead takes its input ids
from the previous graph's sampled tokens on the device (`DecodeGraphs.run`, `ahead`), every
input copied from pinned memory without a stream sync; the results must be the synchronous
loop's, bit for bit (tests/test_async_scheduling.py checks the bookkeeping on the CPU)."""

from __future__ import annotations

import pytest
import torch
from fed_rows import rotating_fed_rows

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from samebits.model.qwen3_moe.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("async_gpu") / "t", seed=4)


def _run(path, flag, params_of, lens=(7, 13, 21, 30, 9, 17), num_blocks=None, **limits):
    from samebits import LLM
    from samebits.verify import make_prompts

    llm = LLM(
        path,
        device="cuda",
        max_num_seqs=4,
        max_model_len=96,
        async_scheduling=flag,
        num_blocks=num_blocks,
        **limits,
    )
    prompts = make_prompts(lens, llm.config.vocab_size, seed=2)
    outs = llm.generate(prompts, params_of(llm.config.vocab_size), progress=False)
    return [[(c.token_ids, c.logprobs, c.finish_reason, c.top_logprobs) for c in o.outputs] for o in outs], llm


def _same(a, b) -> bool:
    return all(
        x[0] == y[0] and torch.equal(x[1], y[1]) and x[2:] == y[2:]
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


def _mixed(vocab):
    from samebits import SamplingParams

    stops = list(range(1, vocab, 23))  # stop tokens fire mid-run: rows dropped after a stop
    return [
        SamplingParams(
            max_tokens=m,
            seed=i,
            temperature=0.0 if i == 3 else 0.9,
            stop_token_ids=stops,
            min_tokens=2,
            n=1 + (i == 1),
        )
        for i, m in enumerate((30, 12, 40, 25, 7, 33))
    ]


@pytest.fixture
def graph_runs(monkeypatch):
    """Counts graph replays launched ahead (their input ids gathered on the device)."""
    from samebits.engine.cuda_graphs import DecodeGraphs

    run, count = DecodeGraphs.run, [0]

    def spy(self, batch, size, reqs, positions, ahead=None):
        count[0] += ahead is not None
        return run(self, batch, size, reqs, positions, ahead)

    monkeypatch.setattr(DecodeGraphs, "run", spy)
    return count


def _narrowed(vocab):
    """top-k, top-p, min_tokens and top log-probs rows: sampled by the per-row device path
    after the replay, the top log-probs copied back with the samples (`sampler.Tops`)."""
    from samebits import SamplingParams

    stops = list(range(1, vocab, 9))
    return [
        SamplingParams(
            max_tokens=m,
            seed=i,
            top_k=40 if i % 2 else -1,
            top_p=0.9 if i % 3 else 1.0,
            min_tokens=3,
            stop_token_ids=stops,
            logprobs=2 if i in (1, 4) else None,
        )
        for i, m in enumerate((30, 12, 40, 25, 7, 33))
    ]


@pytest.mark.parametrize("params_of", [_mixed, _narrowed])
def test_async_scheduling_on_cuda_graphs_gives_the_synchronous_bits(path, graph_runs, params_of):
    """Graph replays launched ahead, the rows' samples left on the device (with top-k, top-p
    and banned tokens too: the per-row path's device ops queued before the next replay)."""
    sync, _ = _run(path, False, params_of)
    assert graph_runs[0] == 0
    got, llm = _run(path, True, params_of)
    assert graph_runs[0] > 20  # most decode steps were graph replays launched ahead
    assert _same(got, sync)
    if params_of is _narrowed:
        return
    assert {x[2] for r in sync for x in r} == {"stop", "length"}
    small_sync, _ = _run(path, False, _mixed, num_blocks=10)  # preemptions: left to the sync path
    small, small_llm = _run(path, True, _mixed, num_blocks=10)
    assert small_llm.scheduler.num_preemptions > 0 and _same(small, small_sync) and _same(small, sync)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_control_graph_fed_a_stale_token_differs(path, monkeypatch):
    """Control for the reason the test above rests on: the ahead replay must read the previous
    step's samples; fed the previous step's input ids instead (stale by one token), it differs."""
    from samebits import SamplingParams
    from samebits.engine.cuda_graphs import DecodeGraphs

    def plain(vocab):
        return SamplingParams(max_tokens=20, seed=5, ignore_eos=True)

    sync, _ = _run(path, False, plain, lens=(7, 13, 21))
    assert _same(_run(path, True, plain, lens=(7, 13, 21))[0], sync)
    run = DecodeGraphs.run

    def stale(self, batch, size, reqs, positions, ahead=None):
        if ahead is not None:
            ahead = (ahead[0], self.i64[0].clone())  # the ids the previous replay read
        return run(self, batch, size, reqs, positions, ahead)

    monkeypatch.setattr(DecodeGraphs, "run", stale)
    assert not _same(_run(path, True, plain, lens=(7, 13, 21))[0], sync)


def _plain_admitting(vocab):
    from samebits import SamplingParams

    return [SamplingParams(max_tokens=m, seed=i, ignore_eos=True) for i, m in enumerate((9, 14, 6, 11, 8, 17))]


@pytest.fixture
def mixed_launches(monkeypatch):
    """Counts eager steps launched ahead with rows whose ids are known on the host
    (admissions, chunked prefills) beside rows fed by the previous step's samples."""
    from samebits.engine.runner import ModelRunner

    launch, count = ModelRunner.launch, [0]

    def spy(self, batch, reqs, ahead=None):
        count[0] += ahead is not None and -1 in ahead[0]
        return launch(self, batch, reqs, ahead)

    monkeypatch.setattr(ModelRunner, "launch", spy)
    return count


@pytest.mark.parametrize("limits", [{}, {"max_num_batched_tokens": 16}])
def test_eager_steps_run_ahead_with_admissions_give_the_synchronous_bits_on_cuda(path, mixed_launches, limits):
    """Eager steps launched ahead (admissions, and with a 16-token budget chunked prefills,
    beside decode rows fed on the device, their samples left on the device as a `Pending`):
    the synchronous bits."""
    sync, _ = _run(path, False, _plain_admitting, **limits)
    assert mixed_launches[0] == 0
    got, llm = _run(path, True, _plain_admitting, **limits)
    assert mixed_launches[0] > 0
    assert _same(got, sync)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_control_eager_steps_fed_rotated_samples_differ_on_cuda(path, monkeypatch):
    """Control for the test above, for the reason it rests on: each fed row of an eager step
    run ahead must read its own sequence's sample on the device; with the fed rows' sources
    rotated among themselves (the known rows left alone) the outputs change."""
    from samebits.engine.runner import ModelRunner

    rotated = [0]
    rotate = rotating_fed_rows(ModelRunner.launch, rotated)

    sync, _ = _run(path, False, _plain_admitting)
    monkeypatch.setattr(ModelRunner, "launch", rotate)
    assert not _same(_run(path, True, _plain_admitting)[0], sync)
    assert rotated[0] > 0


def test_an_eager_step_launched_ahead_does_not_wait_for_the_step_before(path, monkeypatch):
    """The host plans, fills and launches an eager step run ahead (pinned input copies, the
    sample left on the device) while the device is still busy: before each such launch the
    stream gets a ~0.5 s sleep, and after the launch returns the sleep must still be running.
    Control, the reason: an eager step whose samples are read back at once (`sample`'s host
    results) waits for the device, and the same check sees the sleep done."""
    from samebits import LLM
    from samebits.engine import runner as runner_mod
    from samebits.engine.runner import ModelRunner
    from samebits.engine.sampler import Pending, sample
    from samebits.verify import make_prompts

    llm = LLM(path, device="cuda", max_num_seqs=4, max_model_len=96, async_scheduling=True)
    prompts = make_prompts((7, 13, 21, 30, 9, 17), llm.config.vocab_size, seed=2)
    params = _plain_admitting(llm.config.vocab_size)
    llm.generate(prompts, params, progress=False)  # every kernel compiled for these steps
    launch = ModelRunner.launch

    def checked(busy):
        def spy(self, batch, reqs, ahead=None):
            if ahead is None or -1 not in ahead[0]:
                return launch(self, batch, reqs, ahead)
            torch.cuda._sleep(10**9)  # the step before, still running (~0.5 s at ~2 GHz)
            gate = torch.cuda.Event()
            gate.record()
            pending = launch(self, batch, reqs, ahead)
            busy.append(not gate.query())
            return pending

        return spy

    busy = []
    monkeypatch.setattr(ModelRunner, "launch", checked(busy))
    llm.generate(prompts, params, progress=False)
    assert busy and all(busy)

    waited = []
    monkeypatch.setattr(ModelRunner, "launch", checked(waited))

    def read_back(logits, reqs, head=None):
        return Pending.done(sample(logits, reqs, head), "cuda")

    monkeypatch.setattr(runner_mod, "sample_pending", read_back)
    llm.generate(prompts, params, progress=False)
    assert waited and not any(waited)
