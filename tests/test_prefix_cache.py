"""Prefix sharing of KV blocks (engine/block_manager.py) on the tiny model, CPU.

Claim, bitwise: a sequence that takes its prompt's K/V from shared blocks (a sibling of
the same request computing them in the same step, an earlier request, its own blocks
before a preemption) samples the same tokens with the same float32 log-probs as with
`enable_prefix_caching=False`. Controls: a hash that ignores the parent chain shares a
block computed at another position, and cached blocks whose K/V were changed (or kept
across a weight update) are read as they are: both give other bits.
"""

from __future__ import annotations

import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.engine.block_manager import BlockManager
from samebits.engine.config import EngineConfig
from samebits.verify import make_prompts

BS = 16  # the engine's default block size


def _engine(path, caching=True, **kw) -> LLM:
    kw = {"max_num_seqs": 8, "max_model_len": 128} | kw
    return LLM(path, enable_prefix_caching=caching, **kw)


def _record(llm, monkeypatch) -> list[list[tuple[int, int, int]]]:
    """Each step's chunks as (seq_id, start, num_tokens): what the forward computes."""
    steps, launch = [], llm.runner.launch

    def recording(batch, reqs, ahead=None):
        steps.append([(c.seq.seq_id, c.start, c.num_tokens) for c in batch.chunks])
        return launch(batch, reqs, ahead)

    monkeypatch.setattr(llm.runner, "launch", recording)
    return steps


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert torch.equal(a.logprobs, b.logprobs)


def _differ(a, b) -> bool:
    return a.token_ids != b.token_ids or not torch.equal(a.logprobs, b.logprobs)


def _sp(seed, n=1, max_tokens=6):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed, n=n)


def _prompts(llm, lens, seed=0):
    return make_prompts(lens, llm.config.vocab_size, seed)


# -- the n samples of one request ----------------------------------------------------------


def test_n8_prefills_the_prompt_once_in_one_step_and_changes_no_bit(tiny, monkeypatch):
    shared, plain = _engine(tiny), _engine(tiny, caching=False)
    steps, plain_steps = _record(shared, monkeypatch), _record(plain, monkeypatch)
    prompt = _prompts(shared, [2 * BS + 1])[0]  # 33 tokens: two full blocks and one token
    a, b = shared.generate([prompt], _sp(7, n=8))[0], plain.generate([prompt], _sp(7, n=8))[0]
    # step 1: the first sample computes the prompt; the other 7 hit both of its blocks in that
    # same step (K/V are written before attention reads them) and compute only the last token
    ids = [s for s, _, _ in steps[0]]
    assert steps[0] == [(ids[0], 0, 33)] + [(i, 32, 1) for i in ids[1:]]
    assert plain_steps[0] == [(i, 0, 33) for i in [s for s, _, _ in plain_steps[0]]]
    prompt_tokens = [sum(n for _, _, n in step) for step in (steps[0], plain_steps[0])]
    assert prompt_tokens == [33 + 7, 8 * 33]
    assert (shared.core.stats.prefix_cache_queries, shared.core.stats.prefix_cache_hits) == (8 * 33, 7 * 32)
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # the samples differ from each other
    for x, y in zip(a.outputs, b.outputs, strict=True):
        _same(x, y)
    bm = shared.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.cached) > 0  # all freed, still cached


def test_a_prompt_of_whole_blocks_recomputes_its_last_block(tiny, monkeypatch):
    """A full hit is cut before the last token, down to a block boundary: the sequence never
    writes into a shared block, so it recomputes the whole last block."""
    llm = _engine(tiny)
    steps = _record(llm, monkeypatch)
    prompt = _prompts(llm, [2 * BS])[0]
    out = llm.generate([prompt], _sp(3, n=3))[0]
    assert [(start, n) for _, start, n in steps[0]] == [(0, 32), (16, 16), (16, 16)]
    plain = _engine(tiny, caching=False).generate([prompt], _sp(3, n=3))[0]
    for o, ref in zip(out.outputs, plain.outputs, strict=True):
        _same(o, ref)


# -- across requests, with preemption ------------------------------------------------------


def test_a_later_request_hits_an_earlier_ones_prefix_bitwise(tiny):
    shared, plain = _engine(tiny), _engine(tiny, caching=False)
    head, tails = _prompts(shared, [40], seed=1)[0], _prompts(shared, [5, 9], seed=2)
    first, second = head + tails[0], head + tails[1]
    outs = [shared.generate([p], _sp(i))[0] for i, p in enumerate((first, second))]
    assert shared.core.stats.prefix_cache_hits == 32  # the second request: head's two full blocks
    for i, p in enumerate((first, second)):
        _same(outs[i], plain.generate([p], _sp(i))[0])


def test_sharing_with_preemption_is_bitwise(tiny, monkeypatch):
    """8 blocks of 8 slots for 4 requests with a common 24-token head (n=2 each): samples are
    preempted and readmitted (hitting their own or a sibling's blocks), still the same bits as
    preempted and recomputed without sharing, and as a cache large enough for all."""
    kw = dict(max_num_seqs=8, max_model_len=64, block_size=8)
    shared, plain = _engine(tiny, num_blocks=8, **kw), _engine(tiny, caching=False, num_blocks=8, **kw)
    roomy = _engine(tiny, caching=False, **kw)
    head = _prompts(shared, [24], seed=4)[0]
    prompts = [head + t for t in _prompts(shared, [3, 7, 5, 10], seed=5)]
    params = [_sp(10 + i, n=2, max_tokens=12) for i in range(4)]
    steps = _record(shared, monkeypatch)
    runs = [llm.generate(prompts, params) for llm in (shared, plain, roomy)]
    # some readmitted sample resumed past its prompt: its own generated tokens' K/V were a hit
    chunks = [c for step in steps for c in step]
    assert any(n > 1 and start >= len(prompts[sid // 2]) for sid, start, n in chunks)
    assert shared.scheduler.num_preemptions > 0 and plain.scheduler.num_preemptions > 0
    assert roomy.scheduler.num_preemptions == 0 and shared.core.stats.prefix_cache_hits > 0
    for other in runs[1:]:
        for x, y in zip(runs[0], other, strict=True):
            for u, v in zip(x.outputs, y.outputs, strict=True):
                _same(u, v)
    assert shared.block_manager.num_free_blocks == 8


# -- negative controls ---------------------------------------------------------------------


def _unchained(parent: bytes, token_ids: list[int], extra: bytes) -> bytes:
    return BlockManager._block_hash(b"", token_ids, extra)  # the parent chain ignored


def test_control_a_hash_without_the_parent_chain_shares_a_wrong_block(tiny, monkeypatch):
    """Y's first block has the tokens of X's second block: without the chain it hashes the
    same, Y takes K/V computed at positions 16..31 after X's first block, and its bits change.
    With the chained hash Y hits nothing and matches the engine without sharing."""
    a, b, tail = _prompts(_engine(tiny), [BS, BS, 6], seed=6)
    x, y = a + b + tail, b + tail
    plain = _engine(tiny, caching=False).generate([y], _sp(1))[0]
    for broken in (False, True):
        llm = _engine(tiny)
        if broken:
            monkeypatch.setattr(llm.block_manager, "_block_hash", _unchained)
        llm.generate([x], _sp(0))
        out = llm.generate([y], _sp(1))[0]
        assert llm.core.stats.prefix_cache_hits == (BS if broken else 0)
        assert _differ(out, plain) == broken


def test_control_hits_read_the_cached_blocks(tiny):
    """The cross-request comparison can fail: change the K/V of the cached blocks between the
    two requests and the second one's bits change (it reads them instead of computing)."""
    llm = _engine(tiny)
    head, tail = _prompts(llm, [40, 5], seed=7)
    llm.generate([head], _sp(0))
    reference = _engine(tiny, caching=False).generate([head + tail], _sp(1))[0]
    for k, _ in llm.runner.kv_caches:
        for block in llm.block_manager.cached.values():
            k[block * BS : (block + 1) * BS] *= 1.5
    out = llm.generate([head + tail], _sp(1))[0]
    assert llm.core.stats.prefix_cache_hits == 32
    assert _differ(out, reference)


# -- resets --------------------------------------------------------------------------------


def test_reset_prefix_cache_drops_hits_and_refuses_in_flight(tiny):
    llm = _engine(tiny)
    prompt = _prompts(llm, [37], seed=8)[0]
    llm.generate([prompt], _sp(0))
    rid = llm.core.add_request(None, prompt, _sp(1))
    assert llm.reset_prefix_cache() is False  # in flight: nothing done
    while llm.core.has_unfinished():
        llm.core.step()
    llm.core.pop(rid)
    assert llm.core.stats.prefix_cache_hits == 32 and llm.block_manager.cached
    assert llm.reset_prefix_cache() is True and not llm.block_manager.cached
    llm.generate([prompt], _sp(2))
    assert llm.core.stats.prefix_cache_hits == 32  # no new hit after the reset


@pytest.mark.parametrize("reset", [True, False], ids=["update_weights", "control_no_reset"])
def test_update_weights_resets_the_prefix_cache(tiny, monkeypatch, reset):
    """After an update the same prompt gets 0 hits and a fresh engine's bits on the new
    weights; with the reset disabled it reuses the old weights' K/V and its bits differ."""
    llm = _engine(tiny)
    if not reset:
        monkeypatch.setattr(llm.block_manager, "reset_prefix_cache", lambda: None)
    prompt = _prompts(llm, [37], seed=9)[0]
    llm.generate([prompt], _sp(0))
    name = "model.layers.0.self_attn.k_proj.weight"
    new = llm._params[name] * 1.25
    llm.update_weights([(name, new)])
    out = llm.generate([prompt], _sp(0))[0]
    fresh = _engine(tiny, caching=False)
    fresh.update_weights([(name, new)])
    assert llm.core.stats.prefix_cache_hits == (0 if reset else 32)
    assert _differ(out, fresh.generate([prompt], _sp(0))[0]) != reset


@pytest.mark.parametrize("reset", [True, False], ids=["abort_all", "control_no_reset"])
def test_a_failed_step_drops_the_blocks_it_published(tiny, monkeypatch, reset):
    """A step that raises after scheduling has published blocks whose K/V were never written;
    the abort that follows drops them. Control: without that reset the next request reads the
    unwritten (zero) K/V and its bits differ."""
    llm = _engine(tiny)
    prompt = _prompts(llm, [37], seed=13)[0]
    if not reset:
        monkeypatch.setattr(llm.block_manager, "reset_prefix_cache", lambda: None)

    def failing(batch, reqs, ahead=None):
        raise RuntimeError("the device failed")

    monkeypatch.setattr(llm.runner, "launch", failing)
    with pytest.raises(RuntimeError, match="the device failed"):
        llm.generate([prompt], _sp(0))
    assert bool(llm.block_manager.cached) != reset
    monkeypatch.undo()
    out = llm.generate([prompt], _sp(0))[0]
    assert _differ(out, _engine(tiny, caching=False).generate([prompt], _sp(0))[0]) != reset


def test_sleep_and_set_numerics_reset_the_prefix_cache(tiny):
    llm = _engine(tiny)
    for change in (llm.sleep, lambda: llm.set_numerics("exact")):
        llm.generate([_prompts(llm, [20], seed=11)[0]], _sp(0))
        assert llm.block_manager.cached
        change()
        assert not llm.block_manager.cached
        llm.wake_up()


# -- options -------------------------------------------------------------------------------


def test_the_option_is_validated_and_on_the_serve_cli():
    from samebits.cli import build_parser

    assert EngineConfig().enable_prefix_caching is True
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="yes")
    parse = build_parser().parse_args
    assert parse(["serve"]).enable_prefix_caching is True
    assert parse(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False


def test_metrics_export_the_prefix_cache_counters():
    from samebits.serve.metrics import make_registry, render

    class Engine:
        def metrics(self):
            gauges = dict.fromkeys(
                ["num_requests_running", "num_requests_waiting", "requests_in_flight", "kv_blocks_used"], 0
            )
            counters = dict.fromkeys(
                ["generation_tokens", "aborted_requests", "num_preemptions", "engine_steps"], 0
            )
            rest = {"kv_blocks_total": 8, "last_step_seconds": 0.0, "engine_step_seconds": 0.0}
            return gauges | counters | rest | {"prefix_cache_queries": 264, "prefix_cache_hits": 224}

    text = render(make_registry(Engine())).decode()
    assert "samebits_prefix_cache_queries_total 264.0" in text
    assert "samebits_prefix_cache_hits_total 224.0" in text


# -- the block manager and scheduler, plain Python -----------------------------------------


def _seq(i, tokens, max_tokens=4):
    from samebits.engine.sequence import Sequence

    return Sequence(i, i, list(tokens), SamplingParams(max_tokens=max_tokens))


def _admit(bm, seq) -> list[int]:
    """What the scheduler does at admission: hits, then blocks for the whole sequence."""
    hits = bm.cached_prefix(seq)
    assert bm.can_allocate(bm.admission_cost(hits, seq.num_tokens))
    bm.take_prefix(seq, hits)
    bm.allocate(seq, seq.num_tokens)
    bm.publish(seq, seq.num_tokens)
    return hits


def test_block_manager_refcounts_and_the_free_list():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a, b = _seq(0, range(10, 19)), _seq(1, range(10, 19))  # 9 tokens: 2 full blocks + 1
    assert _admit(bm, a) == [] and a.block_table == [0, 1, 2] and len(bm.cached) == 2
    assert bm.admission_cost(bm.cached_prefix(b), 9) == 1  # the hits are held: only a new block
    assert _admit(bm, b) == [0, 1] and b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert [bm.ref_counts[i] for i in range(4)] == [2, 2, 1, 1] and bm.num_free_blocks == 4
    bm.free(a)
    assert [bm.ref_counts[i] for i in range(4)] == [1, 1, 0, 1]
    assert next(iter(bm.free_blocks)) == 2  # a's partial block (no hash) is reused first
    bm.free(b)
    assert bm.num_free_blocks == 8 and all(r == 0 for r in bm.ref_counts)
    assert list(bm.free_blocks)[-2:] == [1, 0]  # cached: the chain's tail is evicted first
    c = _seq(2, range(10, 19))  # the cached-but-free hits come out of the free list
    assert bm.admission_cost(bm.cached_prefix(c), 9) == 3 and _admit(bm, c) == [0, 1]
    assert bm.num_free_blocks == 5


def test_block_manager_evicts_the_least_recently_freed_first():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a, b = _seq(0, [5, 6, 7, 8]), _seq(1, [1, 2, 3, 4])
    _admit(bm, a), _admit(bm, b)
    bm.free(a)
    bm.free(b)
    assert list(bm.free_blocks) == [1, 0, 3, 2]
    bm.allocate(_seq(2, [9]), 1)  # takes block 1: a's second block loses its hash
    assert bm.cached_prefix(_seq(3, [5, 6, 7, 8, 0])) == [0]
    assert bm.cached_prefix(_seq(4, [1, 2, 3, 4, 0])) == [2, 3]


def test_the_chain_keeps_a_block_to_its_position_and_its_prefix():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    _admit(bm, _seq(0, [1, 2, 3, 4, 5]))
    assert bm.cached_prefix(_seq(1, [3, 4, 5])) == []  # [3, 4] was cached after [1, 2] only
    assert bm.cached_prefix(_seq(2, [1, 2, 9, 9, 5])) == [0]  # diverges in block 1
    assert bm.cached_prefix(_seq(3, [1, 2, 3, 4])) == [0]  # at most num_tokens - 1 tokens
    assert bm.cached_prefix(_seq(4, [1, 2, 3, 4, 6])) == [0, 1]
    unchained = BlockManager(8, 2, enable_prefix_caching=True)
    unchained._block_hash = _unchained
    _admit(unchained, _seq(0, [1, 2, 3, 4, 5]))
    assert unchained.cached_prefix(_seq(1, [3, 4, 5])) == [1]  # the control: a wrong share


def test_only_text_sequences_share_and_none_without_the_option():
    on, off = BlockManager(8, 2, enable_prefix_caching=True), BlockManager(8, 2)
    _admit(off, _seq(0, [1, 2, 3]))
    assert not off.cached and off.cached_prefix(_seq(1, [1, 2, 3])) == []
    mm = _seq(2, [1, 2, 3])
    mm.family_state = object()  # a multimodal prompt's state: its K/V depend on more than ids
    _admit(on, mm)
    assert not on.cached
    text = _seq(3, [1, 2, 3])
    _admit(on, text)
    twin = _seq(4, [1, 2, 3])
    twin.family_state = object()
    assert on.cached_prefix(twin) == [] and on.cached_prefix(_seq(5, [1, 2, 3])) == text.block_table[:1]


def test_a_reset_in_flight_stops_publishing_until_recomputed():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    a = _seq(0, [1, 2, 3])
    _admit(bm, a)
    bm.reset_prefix_cache()
    assert not bm.cached and all(h is None for h in bm.block_hash)
    a.append_token(4, 0.0)
    bm.allocate(a, 4)
    bm.publish(a, 4)  # a's K/V straddle the reset: nothing of it is published
    assert not bm.cached
    bm.free(a)
    _admit(bm, a)  # recomputed from token 0 in the new epoch
    assert len(bm.cached) == 2


def test_scheduler_with_sharing_keeps_its_invariants_and_frees_everything():
    """Many requests with common heads, n samples, a cache small enough to preempt: every
    step, a block's count equals the running sequences holding it, no chunk writes into a
    shared block, held + free = all; at the end every block is free and outputs are those of
    the same run without sharing (the fake model's tokens depend on the schedule only if the
    scheduler lost or reordered work)."""
    from samebits.engine.scheduler import Scheduler

    def run(caching):
        bm = BlockManager(8, 4, enable_prefix_caching=caching)
        sched = Scheduler(6, 10, bm)
        heads = [list(range(2, 11)), list(range(20, 26))]
        seqs = [_seq(i, heads[i % 2] + [40 + i] * (i % 3), max_tokens=4 + i % 6) for i in range(12)]
        for s in seqs:
            sched.add(s)
        hits = 0
        while sched.has_unfinished():
            batch = sched.schedule()
            hits += batch.prefix_cache_hits
            held = [b for s in sched.running for b in s.block_table]
            assert all(bm.ref_counts[b] == held.count(b) for b in set(held))
            assert len(set(held)) + bm.num_free_blocks == bm.num_blocks
            for c in batch.chunks:
                first, last = c.start // 4, (c.start + c.num_tokens - 1) // 4
                assert all(bm.ref_counts[b] == 1 for b in c.seq.block_table[first : last + 1])
            token = {c.seq.seq_id: (100 + c.seq.seq_id + c.seq.num_output_tokens, 0.0) for c in batch.chunks}
            sched.postprocess(batch, token)
        assert bm.num_free_blocks == bm.num_blocks and all(r == 0 for r in bm.ref_counts)
        return [s.output_token_ids for s in seqs], sched.num_preemptions, hits

    (shared, preempted, hits), (plain, _, _) = run(True), run(False)
    assert shared == plain and preempted > 0 and hits > 0


# -- CUDA ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graphs", "eager"])
def test_cuda_sharing_is_bitwise_and_a_shared_block_replays_in_a_graph(tiny, monkeypatch, graphs):
    """On CUDA (Triton attention reading the shared pages): n=8 in one step, then n=4 of a
    17-token prompt already cached, whose first step is 4 one-token chunks over a shared
    block: with graphs on it replays as a decode graph. Bitwise equal to no sharing."""
    kw = dict(device="cuda", cuda_graphs=graphs)
    shared, plain = _engine(tiny, **kw), _engine(tiny, caching=False, **kw)
    p33, p17 = _prompts(shared, [33, 17], seed=12)
    replayed = []
    if graphs:
        run = shared.runner.graphs.run

        def recording(batch, size, reqs, positions, ahead=None):
            replayed.append([(c.start, c.num_tokens) for c in batch.chunks])
            return run(batch, size, reqs, positions, ahead)

        monkeypatch.setattr(shared.runner.graphs, "run", recording)
    for prompt, n in ((p33, 8), (p17, 1), (p17, 4)):
        a, b = shared.generate([prompt], _sp(n, n=n))[0], plain.generate([prompt], _sp(n, n=n))[0]
        for x, y in zip(a.outputs, b.outputs, strict=True):
            _same(x, y)
    assert shared.core.stats.prefix_cache_hits == 7 * 32 + 4 * 16
    assert ([(16, 1)] * 4 in replayed) == graphs
