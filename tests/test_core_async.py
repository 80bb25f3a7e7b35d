"""AsyncEngine: concurrent streamed requests get their alone bits; abort; bad requests."""

from __future__ import annotations

import asyncio

import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.engine.async_engine import AsyncEngine
from samebits.verify import make_prompts


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, max_num_seqs=4, max_model_len=128)


@pytest.fixture
def engine(llm):
    eng = AsyncEngine(llm)
    yield eng
    eng.close()


def _params(i, n=1):
    return SamplingParams(temperature=1.0, max_tokens=10 + i, ignore_eos=True, seed=i, n=n)


async def _collect(engine, prompt, params, rid):
    outs = [o async for o in engine.generate(prompt, params, rid)]
    return outs


def test_concurrent_streams_equal_generate_alone(llm, engine):
    prompts = make_prompts((5, 9, 13, 4, 7, 11, 6, 8), llm.config.vocab_size, seed=2)
    params = [_params(i, n=1 + i % 2) for i in range(8)]

    async def main():
        tasks = []
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            tasks.append(asyncio.create_task(_collect(engine, p, sp, f"r{i}")))
            await asyncio.sleep(0)  # let the request reach the engine while others decode
        return await asyncio.gather(*tasks)

    streams = asyncio.run(main())
    for p, sp, outs in zip(prompts, params, streams, strict=True):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        for a, b in zip(outs[:-1], outs[1:], strict=True):  # cumulative: each extends the last
            assert b.token_ids[: len(a.token_ids)] == a.token_ids
        want = llm.generate([p], sp)[0]
        for x, y in zip(final.outputs, want.outputs, strict=True):
            assert x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_abort_and_closing_a_stream_free_blocks(llm, engine):
    async def main():
        gen = engine.generate([3, 4, 5], _params(0), "x")
        first = await gen.__anext__()
        engine.abort("x")
        rest = [o async for o in gen]
        closed = engine.generate([3, 4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True, seed=1), "y")
        await closed.__anext__()
        await closed.aclose()  # a client that went away
        after = await _collect(engine, [7, 8], _params(1), "z")  # queued behind the abort
        return first, rest, after

    first, rest, after = asyncio.run(main())
    assert not first.finished and rest[-1].finish_reason == "abort"
    assert after[-1].finish_reason == "length"
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert not llm.core.has_unfinished() and llm.core.request_ids() == []


def test_bad_request_raises_and_the_engine_keeps_serving(llm, engine):
    async def main():
        with pytest.raises(ValueError, match="request 0: prompt token id 9999"):
            await _collect(engine, [9999], _params(0), None)
        with pytest.raises(ValueError, match="already in flight"):
            gen = engine.generate([1, 2], _params(0), "dup")
            await gen.__anext__()
            await _collect(engine, [1, 2], _params(0), "dup")
        await gen.aclose()
        return await _collect(engine, [1, 2], _params(0), "ok")

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "length"


def test_generate_is_refused_while_async_requests_are_in_flight(llm, engine):
    async def main():
        gen = engine.generate([3, 4], SamplingParams(max_tokens=60, ignore_eos=True), "busy")
        await gen.__anext__()
        with pytest.raises(RuntimeError, match="in flight"):
            llm.generate([[1, 2]])
        with pytest.raises(RuntimeError, match="update_weights: .* in flight"):
            llm.update_weights([])
        await gen.aclose()

    asyncio.run(main())


def test_a_caller_cancelled_before_its_request_starts_leaves_nothing_running(llm, engine):
    async def main():
        for rid in ("c0", "c1", "c2"):
            gen = engine.generate([3, 4], SamplingParams(max_tokens=60, ignore_eos=True), rid)
            task = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0)  # the add is submitted; cancel while it waits for the engine
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return await _collect(engine, [7, 8], _params(1), "after")

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "length"
    assert llm.core.request_ids() == [] and not llm.core.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
