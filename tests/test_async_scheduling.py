"""Async scheduling: the step after this one is scheduled and launched before this one's
samples are read (engine/core.py `EngineCore.step`). Every request must get exactly the
tokens, log-probs, text and finish reasons the synchronous loop gives it; on the CPU the host
waits for each step anyway, so these tests check the bookkeeping (decode rows' input ids taken
from the previous step's samples, output indices one ahead, admissions and chunked prefills
beside them, rows with banned tokens, top-k/top-p or top log-probs, rows of sequences that
ended meanwhile dropped, blocks published later, preemptions left to the synchronous
scheduler). The CUDA side is tests/test_async_gpu.py's."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from fed_rows import rotating_fed_rows

from samebits import LLM, SamplingParams
from samebits.engine.runner import ModelRunner
from samebits.model.tiny_tokenizer import add_tiny_tokenizer
from samebits.verify import make_prompts


@pytest.fixture(scope="module")
def tok_ckpt(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("async") / "tiny"
    shutil.copytree(tiny, path)
    return add_tiny_tokenizer(path)


@pytest.fixture
def ahead_launches(monkeypatch):
    """Counts the steps launched ahead (the path under test must actually run): [all of
    them, those with rows whose ids are known on the host (admissions, chunked prefills)]."""
    launch, count = ModelRunner.launch, [0, 0]

    def spy(self, batch, reqs, ahead=None):
        count[0] += ahead is not None
        count[1] += ahead is not None and -1 in ahead[0]
        return launch(self, batch, reqs, ahead)

    monkeypatch.setattr(ModelRunner, "launch", spy)
    return count


def _outputs(llm, prompts, params):
    outs = llm.generate(prompts, params, progress=False)
    return [[(c.token_ids, c.logprobs, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def _same(a, b) -> bool:
    return all(
        x[0] == y[0] and torch.equal(x[1], y[1]) and x[2:] == y[2:]
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


def _mixed(vocab: int):
    """Stop tokens that fire mid-run (1 id in 23), min_tokens, greedy rows, n=2, lengths
    that end on block boundaries and not: rows end by length and by stop while later steps
    are already launched."""
    stops = list(range(1, vocab, 23))
    lens = (20, 7, 33, 16, 12, 40, 3, 25)
    return [
        SamplingParams(
            max_tokens=m,
            seed=i,
            temperature=0.0 if i % 4 == 3 else 1.0,
            stop_token_ids=stops,
            min_tokens=2,
            n=2 if i == 1 else 1,
        )
        for i, m in enumerate(lens)
    ]


def test_async_scheduling_gives_every_request_the_synchronous_tokens_and_bits(tiny, ahead_launches):
    # 8 requests (9 samples) over 4 slots: admissions, drops after stop tokens, greedy rows
    def run(flag):
        llm = LLM(tiny, max_num_seqs=4, max_model_len=128, async_scheduling=flag)
        prompts = make_prompts((30, 5, 47, 12, 9, 20, 16, 31), llm.config.vocab_size, seed=3)
        return _outputs(llm, prompts, _mixed(llm.config.vocab_size)), llm.core.stats

    sync, sync_stats = run(False)
    assert ahead_launches[0] == 0
    got, stats = run(True)
    assert ahead_launches[0] > 20  # most decode steps ran ahead
    assert _same(got, sync)
    reasons = {x[3] for r in sync for x in r}
    assert reasons == {"stop", "length"}  # both kinds of end happened
    # dropped rows (a stop token ended the sequence while its next step ran) are not counted
    assert stats.generated_tokens == sync_stats.generated_tokens == sum(len(x[0]) for r in sync for x in r)


def test_control_ahead_steps_fed_another_rows_sample_give_other_tokens(tiny, monkeypatch):
    """The control for the test above, for the reason it rests on: a step launched ahead takes
    its input ids from the previous step's samples by row; fed the rows rotated by one, the
    outputs change (so the equality above is not vacuous)."""
    launch = ModelRunner.launch

    def rotated(self, batch, reqs, ahead=None):
        if ahead is not None:
            src, tokens = ahead
            ahead = (src[1:] + src[:1], tokens)
        return launch(self, batch, reqs, ahead)

    def run(flag):
        llm = LLM(tiny, max_num_seqs=4, max_model_len=128, async_scheduling=flag)
        prompts = make_prompts((30, 5, 47, 12), llm.config.vocab_size, seed=3)
        params = SamplingParams(max_tokens=12, seed=1, ignore_eos=True)
        return _outputs(llm, prompts, params)

    sync = run(False)
    assert _same(run(True), sync)
    monkeypatch.setattr(ModelRunner, "launch", rotated)
    assert not _same(run(True), sync)


def test_stop_strings_abort_and_preemption_with_async_scheduling(tok_ckpt, ahead_launches):
    """Text and stop strings (a stop string ends a sample one step after its next step was
    launched), and a cache so small that sequences are preempted: the synchronous results."""

    def run(flag, num_blocks=None):
        llm = LLM(tok_ckpt, max_num_seqs=4, max_model_len=96, async_scheduling=flag, num_blocks=num_blocks)
        base = llm.generate([[5, 6]], SamplingParams(max_tokens=40, ignore_eos=True, seed=3), progress=False)[0]
        params = [
            SamplingParams(max_tokens=40, ignore_eos=True, seed=3, stop=[base.text[10:12]]),
            SamplingParams(max_tokens=30, ignore_eos=True, seed=4, n=2),
            SamplingParams(max_tokens=35, ignore_eos=True, seed=5),
        ]
        prompts = make_prompts((5, 40, 23), llm.config.vocab_size, seed=4)
        prompts[0] = [5, 6]
        return _outputs(llm, prompts, params), llm.scheduler.num_preemptions

    sync, _ = run(False)
    assert sync[0][0][3] == "stop"  # the stop string fired
    got, _ = run(True)
    assert _same(got, sync)
    small_sync, pre_sync = run(False, num_blocks=9)
    small, pre = run(True, num_blocks=9)
    assert pre_sync > 0 and pre > 0  # the small cache preempted in both
    assert _same(small, small_sync) and _same(small, sync)
    assert ahead_launches[0] > 0


def test_abort_while_a_step_runs_ahead_drops_its_rows_and_frees_every_block(tiny):
    llm = LLM(tiny, max_num_seqs=4, max_model_len=128, async_scheduling=True)
    sync = LLM(tiny, max_num_seqs=4, max_model_len=128, async_scheduling=False)
    prompts = make_prompts((12, 20, 7), llm.config.vocab_size, seed=5)
    params = SamplingParams(max_tokens=30, ignore_eos=True, seed=2)
    core = llm.core
    with core.lock:
        ids = [core.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        for _ in range(6):  # prefill, then decode steps, each launching the next
            core.step()
        assert core._inflight is not None  # a step is running ahead now
        assert core.abort("r1")
        while core.has_unfinished():
            core.step()
        outs = [core.pop(r) for r in ids]
    assert outs[1].finish_reason == "abort" and len(outs[1].token_ids) < 30
    want = sync.generate([prompts[0], prompts[2]], params, progress=False)
    for o, w in zip([outs[0], outs[2]], want, strict=True):
        assert o.token_ids == w.token_ids and torch.equal(o.logprobs, w.logprobs)
    # the aborted row's ahead step wrote into blocks freed meanwhile: none is leaked
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_blocks_filled_by_steps_run_ahead_are_published_for_prefix_sharing(tiny):
    """A follow-up request whose prompt is a first request's prompt + output hits the blocks
    the decode steps (run ahead, publishing nothing at schedule time) filled."""

    def run(flag):
        llm = LLM(tiny, max_num_seqs=2, max_model_len=128, async_scheduling=flag)
        prompt = make_prompts((9,), llm.config.vocab_size, seed=6)[0]
        first = llm.generate([prompt], SamplingParams(max_tokens=60, ignore_eos=True, seed=1), progress=False)[
            0
        ]
        hits = llm.core.stats.prefix_cache_hits
        follow = llm.generate(
            [prompt + first.token_ids], SamplingParams(max_tokens=5, ignore_eos=True, seed=2), progress=False
        )[0]
        return llm.core.stats.prefix_cache_hits - hits, first, follow

    hits_sync, first_sync, follow_sync = run(False)
    hits, first, follow = run(True)
    assert hits == hits_sync == (9 + 60) // 16 * 16  # every full block of prompt + output
    for a, b in ((first, first_sync), (follow, follow_sync)):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)


def test_async_scheduling_is_checked_and_defaults_to_the_device(tiny):
    with pytest.raises(ValueError, match="async_scheduling must be None or a bool"):
        LLM(tiny, max_num_seqs=2, max_model_len=64, async_scheduling="yes")
    assert LLM(tiny, max_num_seqs=2, max_model_len=64).core.async_scheduling is False  # the CPU default


def test_streams_through_the_async_engine_with_steps_run_ahead(tiny, ahead_launches):
    """AsyncEngine (requests arriving between steps, an abort while a step runs ahead): each
    stream ends with the tokens `generate` gives its request alone, synchronously."""
    import asyncio

    from samebits.engine.async_engine import AsyncEngine

    llm = LLM(tiny, max_num_seqs=4, max_model_len=128, async_scheduling=True)
    sync = LLM(tiny, max_num_seqs=4, max_model_len=128, async_scheduling=False)
    prompts = make_prompts((5, 9, 13, 4, 7, 11), llm.config.vocab_size, seed=2)
    params = [SamplingParams(temperature=1.0, max_tokens=14 + i, ignore_eos=True, seed=i) for i in range(6)]
    engine = AsyncEngine(llm)

    async def collect(i):
        return [o async for o in engine.generate(prompts[i], params[i], f"r{i}")]

    async def main():
        tasks = []
        for i in range(6):
            tasks.append(asyncio.create_task(collect(i)))
            await asyncio.sleep(0)
        gen = engine.generate([3, 4, 5], SamplingParams(max_tokens=60, ignore_eos=True, seed=9), "x")
        await gen.__anext__()
        await gen.__anext__()
        engine.abort("x")
        aborted = [o async for o in gen]
        return await asyncio.gather(*tasks), aborted

    try:
        streams, aborted = asyncio.run(main())
    finally:
        engine.close()
    assert aborted[-1].finish_reason == "abort" and len(aborted[-1].token_ids) < 60
    for i, outs in enumerate(streams):
        want = sync.generate([prompts[i]], params[i], progress=False)[0]
        assert outs[-1].token_ids == want.token_ids and torch.equal(outs[-1].logprobs, want.logprobs)
    assert ahead_launches[0] > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_a_failed_step_with_a_step_in_flight_leaves_a_clean_engine(tiny, monkeypatch):
    """An error while a step runs ahead (here: in the bookkeeping of the step before it): the
    generate call raises, the step in flight is waited for and dropped, every block is free,
    and the next call gives the synchronous bits."""
    llm = LLM(tiny, max_num_seqs=4, max_model_len=128, async_scheduling=True)
    sync = LLM(tiny, max_num_seqs=4, max_model_len=128, async_scheduling=False)
    prompts = make_prompts((12, 20, 7), llm.config.vocab_size, seed=5)
    params = SamplingParams(max_tokens=20, ignore_eos=True, seed=2)
    postprocess, calls = llm.scheduler.postprocess, [0]

    def failing(batch, sampled):
        calls[0] += 1
        if calls[0] == 6:
            assert llm.core._inflight is not None  # the failure hits with a step launched ahead
            raise RuntimeError("bookkeeping failed")
        return postprocess(batch, sampled)

    monkeypatch.setattr(llm.scheduler, "postprocess", failing)
    with pytest.raises(RuntimeError, match="bookkeeping failed"):
        llm.generate(prompts, params, progress=False)
    monkeypatch.undo()
    assert llm.core._inflight is None and not llm.core.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    got, want = llm.generate(prompts, params, progress=False), sync.generate(prompts, params, progress=False)
    assert all(
        a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
        for a, b in zip(got, want, strict=True)
    )


def test_a_length_finish_admits_the_waiting_sequence_in_the_step_planned_ahead(tiny, monkeypatch):
    """5 requests over 2 slots, ends by length only: the steps (which rows, which tokens) are
    the synchronous loop's, one by one; a finish known ahead frees its slot in the step
    planned ahead, which admits the next request at once, as the synchronous loop does.
    Control, the reason: with stop tokens (unknown ahead) a dropped row and a one-step-later
    admission show up."""

    def steps_of(flag, params):
        llm = LLM(tiny, max_num_seqs=2, max_model_len=128, async_scheduling=flag)
        prompts = make_prompts((9, 14, 6, 11, 8), llm.config.vocab_size, seed=7)
        launch, record = ModelRunner.launch, []

        def spy(self, batch, reqs, ahead=None):
            record.append(tuple((c.seq.index, c.start, c.num_tokens) for c in batch.chunks))
            return launch(self, batch, reqs, ahead)

        monkeypatch.setattr(ModelRunner, "launch", spy)
        try:
            llm.generate(prompts, params, progress=False)
        finally:
            monkeypatch.undo()
        return record

    lengths = [SamplingParams(max_tokens=m, ignore_eos=True, seed=i) for i, m in enumerate((12, 5, 9, 14, 7))]
    assert steps_of(True, lengths) == steps_of(False, lengths)
    stops = [SamplingParams(max_tokens=40, seed=i, stop_token_ids=list(range(1, 384, 19))) for i in range(5)]
    assert steps_of(True, stops) != steps_of(False, stops)


def _admitting(vocab: int):
    """Plain rows (no sampling rules), n = 2 on a shared prompt, ends by
    length and by stop tokens: waiting requests are admitted beside decoding ones."""
    stops = list(range(1, vocab, 29))
    return [
        SamplingParams(max_tokens=m, seed=i, stop_token_ids=stops if i % 3 == 0 else None, n=1 + (i == 2))
        for i, m in enumerate((9, 14, 6, 11, 8, 17, 5, 12))
    ]


@pytest.mark.parametrize("limits", [{}, {"max_num_batched_tokens": 16, "enable_prefix_caching": True}])
def test_steps_run_ahead_admit_and_prefill_with_the_synchronous_bits(tiny, ahead_launches, limits):
    """Steps launched ahead that admit waiting requests and go on with chunked prefills
    (their ids known on the host) beside decode rows fed by the previous step's samples,
    with prefix sharing: every request gets the synchronous tokens and bits."""

    def run(flag):
        llm = LLM(tiny, max_num_seqs=4, max_model_len=128, async_scheduling=flag, **limits)
        prompts = make_prompts((30, 5, 47, 12, 9, 20, 16, 31), llm.config.vocab_size, seed=8)
        return _outputs(llm, prompts, _admitting(llm.config.vocab_size)), llm

    sync, sync_llm = run(False)
    assert ahead_launches == [0, 0]
    got, llm = run(True)
    assert ahead_launches[1] >= 4  # steps run ahead with known rows beside fed ones
    assert _same(got, sync)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    # the n samples of a chunked prompt prefill it once either way (a chunk run ahead publishes
    # its blocks before that step's admissions, as the synchronous step does)
    assert llm.core.stats.prefix_cache_hits == sync_llm.core.stats.prefix_cache_hits


def test_control_mixed_ahead_steps_fed_rotated_samples_give_other_tokens(tiny, monkeypatch):
    """Control for the test above, for the reason it rests on: in a step run ahead with known
    rows (admissions) beside fed ones, each fed row must read its own sequence's sample;
    with the fed rows' sources rotated among themselves (the known rows left alone), the
    outputs change."""
    rotated = [0]
    rotate = rotating_fed_rows(ModelRunner.launch, rotated)

    def run(flag):
        llm = LLM(tiny, max_num_seqs=4, max_model_len=128, async_scheduling=flag)
        prompts = make_prompts((30, 5, 47, 12, 9, 20, 16, 31), llm.config.vocab_size, seed=8)
        return _outputs(llm, prompts, _admitting(llm.config.vocab_size))

    sync = run(False)
    monkeypatch.setattr(ModelRunner, "launch", rotate)
    assert not _same(run(True), sync)
    assert rotated[0] > 0


def test_requests_asking_for_top_logprobs_run_ahead_with_the_synchronous_tops(tiny, monkeypatch):
    """Requests that ask for top log-probs (their lists stay on the device until the step is
    read, `sampler.Tops`) are admitted and decoded by steps run ahead, in the same steps as
    the synchronous loop, with its tokens, bits and top log-probs. Control, the reason: with
    each step's lists handed to the rows in rotated order, the top log-probs differ."""
    from samebits.engine.sampler import Tops

    def run(flag):
        llm = LLM(tiny, max_num_seqs=2, max_model_len=128, async_scheduling=flag)
        prompts = make_prompts((9, 14, 6, 11), llm.config.vocab_size, seed=7)
        params = [SamplingParams(max_tokens=m, ignore_eos=True, seed=i) for i, m in enumerate((4, 20, 9, 6))]
        params[1] = SamplingParams(max_tokens=20, ignore_eos=True, seed=1, logprobs=3)
        params[2] = SamplingParams(max_tokens=9, ignore_eos=True, seed=2, logprobs=2)
        launch, joined, ahead = ModelRunner.launch, [], [0]

        def spy(self, batch, reqs, fed=None):
            ahead[0] += fed is not None and any(r.params.logprobs for r in reqs)
            if any(c.seq.index == 2 and c.start == 0 for c in batch.chunks):
                joined.append([c.seq.index for c in batch.chunks])
            return launch(self, batch, reqs, fed)

        monkeypatch.setattr(ModelRunner, "launch", spy)
        try:
            outs = llm.generate(prompts, params, progress=False)
        finally:
            monkeypatch.setattr(ModelRunner, "launch", launch)
        return [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs], joined, ahead[0]

    sync, joined_sync, _ = run(False)
    got, joined, ahead = run(True)
    assert ahead > 10 and joined == joined_sync == [[1, 2]]  # admitted beside request 1 either way
    assert sync[1][2] and sync[2][2]
    same = [a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(got, sync, strict=True)]
    assert all(same)
    lists = Tops.lists

    def rotated(self, ids, logprobs):
        out = lists(self, ids, logprobs)
        rows = list(out)
        return {r: out[rows[(j + 1) % len(rows)]] for j, r in enumerate(rows)}

    monkeypatch.setattr(Tops, "lists", rotated)
    assert [a[2] for a in run(True)[0]] != [b[2] for b in sync]


def test_steps_with_known_rows_beside_fed_ones_never_replay_a_graph(tiny):
    """A graph gathers every row's input id from the previous step's samples, so a step run
    ahead with a row whose ids are known on the host (an admitted one-token prompt beside a
    decode row: every chunk one token, which `DecodeGraphs.size_for` accepts) must run
    eagerly; an all-fed step, or one with nothing fed, takes the graph's size (the control:
    the same stand-in graphs answer 1 there)."""
    llm = LLM(tiny, max_num_seqs=2, max_model_len=64)
    runner = llm.runner
    runner.graphs = SimpleNamespace(size_for=lambda batch: 1)  # a stand-in: CUDA graphs on the CPU
    tokens = torch.tensor([7, 9])
    assert runner.graph_size(None, {}, ([1, -1], tokens)) is None
    assert runner.graph_size(None, {}, ([-1, 0], tokens)) is None
    assert runner.graph_size(None, {}, ([1, 0], tokens)) == 1
    assert runner.graph_size(None, {}, None) == 1
    assert runner.graph_size(None, {"multimodal": object()}, None) is None


def test_rows_with_banned_tokens_and_top_k_top_p_run_ahead_with_the_synchronous_bits(tiny, monkeypatch):
    """Rows whose sampling narrows the distribution (top-k, top-p, min_tokens banning the stop
    tokens and eos) are sampled by device ops, so their steps run ahead too (one output index
    ahead: the banned list follows it), with the synchronous tokens and bits. Control, the
    reason: with the steps run ahead told one output index less (their noise keys and
    min_tokens' bans one token behind), the outputs change."""
    from samebits.engine.llm import LLM as LLMClass

    stops = list(range(1, 384, 9))  # a ninth of the vocabulary: stops fire after min_tokens

    def params(i):
        return SamplingParams(max_tokens=12, seed=i, top_k=40 if i % 2 else -1, top_p=0.9 if i % 3 else 1.0,
                              min_tokens=4, stop_token_ids=stops)  # fmt: skip

    def run(flag):
        llm = LLM(tiny, max_num_seqs=4, max_model_len=128, async_scheduling=flag)
        prompts = make_prompts((9, 14, 6, 11, 8, 17), llm.config.vocab_size, seed=3)
        launch, ahead = ModelRunner.launch, [0]

        def spy(self, batch, reqs, fed=None):
            ahead[0] += fed is not None and any(r.banned or r.params.top_k != -1 for r in reqs)
            return launch(self, batch, reqs, fed)

        monkeypatch.setattr(ModelRunner, "launch", spy)
        try:
            outs = _outputs(llm, prompts, [params(i) for i in range(6)])
        finally:
            monkeypatch.undo()
        return outs, ahead[0]

    sync, _ = run(False)
    got, ahead = run(True)
    assert ahead > 10  # steps with narrowed rows ran ahead
    assert _same(got, sync)
    assert {x[3] for r in sync for x in r} == {"stop", "length"}
    requests = LLMClass._sample_requests
    monkeypatch.setattr(
        LLMClass, "_sample_requests", lambda self, seqs, ahead=0: requests(self, seqs, max(ahead - 1, 0))
    )
    assert not _same(run(True)[0], sync)
