"""The scheduler and block manager, in plain Python (no model, no torch device)."""

from __future__ import annotations

import pytest

from samebits.engine.block_manager import BlockManager
from samebits.engine.sampling_params import SamplingParams
from samebits.engine.scheduler import Scheduler
from samebits.engine.sequence import Sequence, SequenceStatus


def _seq(i, n_prompt, **kw):
    return Sequence(i, i, list(range(2, 2 + n_prompt)), SamplingParams(**kw))


def _drive(sched, token=lambda seq: 7, max_steps=10_000):
    """Run the scheduler with a fake runner; returns the batches it scheduled."""
    batches = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return batches
        batch = sched.schedule()
        assert batch.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        batches.append([(c.seq.seq_id, c.start, c.num_tokens) for c in batch.chunks])
        sched.postprocess(batch, {c.seq.seq_id: (token(c.seq), -0.5) for c in batch.chunks if c.samples})
    raise AssertionError("scheduler did not finish")


def test_block_manager_allocates_and_frees():
    bm = BlockManager(4, 8)
    s = _seq(0, 10)
    assert bm.blocks_needed(s, 10) == 2
    bm.allocate(s, 10)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 2
    assert bm.blocks_needed(s, 16) == 0 and bm.blocks_needed(s, 17) == 1
    with pytest.raises(RuntimeError, match="need 3 KV blocks, 2 free"):
        bm.allocate(s, 40)
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 4
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_chunked_prefill_splits_long_prompts_under_the_budget():
    sched = Scheduler(4, 8, BlockManager(64, 4))
    sched.add(_seq(0, 21, max_tokens=2))
    batches = _drive(sched)
    assert batches[:3] == [[(0, 0, 8)], [(0, 8, 8)], [(0, 16, 5)]]
    assert batches[3] == [(0, 21, 1)]  # decode of the first sampled token


def test_max_num_seqs_and_fifo_admission():
    sched = Scheduler(2, 64, BlockManager(64, 4))
    seqs = [_seq(i, 3, max_tokens=3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batches = _drive(sched)
    assert [sid for sid, _, _ in batches[0]] == [0, 1]
    assert all(len(b) <= 2 for b in batches)
    assert all(s.finish_reason == "length" and s.num_output_tokens == 3 for s in seqs)


def test_preemption_by_recompute_readmits_first_and_finishes():
    bm = BlockManager(5, 4)  # 20 slots: two sequences of 12 tokens do not fit at once
    sched = Scheduler(4, 64, bm)
    a, b = _seq(0, 4, max_tokens=8), _seq(1, 4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    batches = _drive(sched)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.num_output_tokens == b.num_output_tokens == 8
    # b was recomputed from position 0 over its prompt and the tokens it had generated
    assert any(sid == 1 and start == 0 and n > 4 for bt in batches for sid, start, n in bt)
    assert bm.num_free_blocks == 5


def test_a_sequence_that_can_never_fit_is_refused():
    sched = Scheduler(4, 64, BlockManager(2, 4))
    with pytest.raises(RuntimeError, match="raise num_blocks"):
        sched.add(_seq(0, 6, max_tokens=5))


def test_finish_reasons():
    sched = Scheduler(4, 64, BlockManager(64, 4), eos_token_ids=(1,))
    eos = _seq(0, 3, max_tokens=10)
    ignore = _seq(1, 3, max_tokens=4, ignore_eos=True)
    stop = _seq(2, 3, max_tokens=10, stop_token_ids=[1])
    late = _seq(3, 3, max_tokens=10, min_tokens=3)
    for s in (eos, ignore, stop, late):
        sched.add(s)
    _drive(sched, token=lambda seq: 1)
    assert (eos.finish_reason, eos.num_output_tokens) == ("stop", 1)
    assert (ignore.finish_reason, ignore.num_output_tokens) == ("length", 4)
    assert (stop.finish_reason, stop.num_output_tokens) == ("stop", 1)
    assert (late.finish_reason, late.num_output_tokens) == ("stop", 3)


def test_abort_all_frees_everything():
    bm = BlockManager(16, 4)
    sched = Scheduler(2, 64, bm)
    seqs = [_seq(i, 5, max_tokens=5) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.postprocess(sched.schedule(), {0: (7, -1.0), 1: (7, -1.0)})
    aborted = sched.abort_all()
    assert {s.seq_id for s in aborted} == {0, 1, 2}
    assert all(s.status is SequenceStatus.FINISHED and s.finish_reason == "abort" for s in seqs)
    assert not sched.has_unfinished() and bm.num_free_blocks == 16


def test_no_state_grows_with_requests_ever_seen():
    sched = Scheduler(4, 64, BlockManager(64, 4))
    for wave in range(50):
        for i in range(4):
            sched.add(_seq(wave * 4 + i, 3, max_tokens=2))
        _drive(sched)
        assert not sched.waiting and not sched.running
    assert sum(len(v) if hasattr(v, "__len__") else 0 for v in vars(sched).values()) <= 1  # eos set
