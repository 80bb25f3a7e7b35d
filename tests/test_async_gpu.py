"""CUDA: async scheduling through the CUDA graphs. A step launched ahead takes its input ids
from the previous graph's sampled tokens on the device (`DecodeGraphs.run`, `ahead`), every
input copied from pinned memory without a stream sync; the results must be the synchronous
loop's, bit for bit (tests/test_async_scheduling.py checks the bookkeeping on the CPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from samebits.model.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("async_gpu") / "t", seed=4)


def _run(path, flag, params_of, lens=(7, 13, 21, 30, 9, 17), num_blocks=None):
    from samebits import LLM
    from samebits.verify import make_prompts

    llm = LLM(
        path, device="cuda", max_num_seqs=4, max_model_len=96, async_scheduling=flag, num_blocks=num_blocks
    )
    prompts = make_prompts(lens, llm.config.vocab_size, seed=2)
    outs = llm.generate(prompts, params_of(llm.config.vocab_size), progress=False)
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs], llm


def _same(a, b) -> bool:
    return all(
        x[0] == y[0] and torch.equal(x[1], y[1]) and x[2] == y[2]
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


def test_async_scheduling_on_cuda_graphs_gives_the_synchronous_bits(path, graph_runs):
    sync, _ = _run(path, False, _mixed)
    assert graph_runs[0] == 0
    got, llm = _run(path, True, _mixed)
    assert graph_runs[0] > 20  # most decode steps were graph replays launched ahead
    assert _same(got, sync)
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
