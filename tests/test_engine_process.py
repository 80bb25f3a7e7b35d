"""`EngineProcess`: the engine core in a child process, behind AsyncEngine's interface.

The claims: concurrent requests through the process give `LLM.generate`'s tokens and
float32 log-probs bit for bit (the transport carries float32 -> Python float -> float32,
which is exact; the control shows a lossy transport would be caught); a child that dies
ends every stream with EngineDeadError; a child that cannot build its model raises its
error in the parent.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.engine.async_engine import EngineDeadError
from samebits.engine.engine_process import EngineProcess

KW = {"max_num_seqs": 4, "max_model_len": 96}


@pytest.fixture(scope="module")
def proc(tiny):
    engine = EngineProcess({"model": tiny, **KW})
    yield engine
    engine.close()


def _params(i: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=12 + i, temperature=0.8 + 0.1 * i, seed=100 + i, ignore_eos=True, n=1 + i % 2
    )


PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 38, 32], [79, 50], [28, 84, 19, 71, 69, 39]]


async def _all(engine, prompts, params):
    async def one(p, sp):
        last = None
        async for out in engine.generate(p, sp):
            last = out
        return last

    return await asyncio.gather(*[one(p, sp) for p, sp in zip(prompts, params, strict=True)])


def test_concurrent_requests_give_llm_generate_bits(proc, tiny):
    params = [_params(i) for i in range(len(PROMPTS))]
    got = asyncio.run(_all(proc, PROMPTS, params))  # 5 requests (8 samples) over 4 slots
    want = LLM(tiny, **KW).generate(PROMPTS, params, progress=False)
    assert all(o.finished for o in got)
    lossy = 0
    for g, w in zip(got, want, strict=True):
        assert g.prompt_token_ids == w.prompt_token_ids
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert gc.token_ids == wc.token_ids and gc.finish_reason == wc.finish_reason
            assert gc.logprobs.dtype == torch.float32 and torch.equal(gc.logprobs, wc.logprobs)
            # control: the same comparison through a lossy transport (6 significant digits) fails
            rounded = torch.tensor([float(f"{x:.6g}") for x in gc.logprobs.tolist()], dtype=torch.float32)
            lossy += int(not torch.equal(rounded, wc.logprobs))
    assert lossy > 0


def test_bad_request_is_a_value_error_naming_the_field(proc):
    async def go():
        async for _ in proc.generate([1, 2, 10**9], SamplingParams(max_tokens=2)):
            pass

    with pytest.raises(ValueError, match="prompt token id 1000000000 at position 2"):
        asyncio.run(go())
    assert proc.error is None and proc.num_in_flight() == 0


def test_model_that_cannot_be_built_raises_in_the_parent(tiny):
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineProcess({"model": tiny, "max_num_seqs": 0})


def test_a_killed_engine_process_ends_every_stream_with_engine_dead(tiny):
    engine = EngineProcess({"model": tiny, **KW})

    async def go():
        gen = engine.generate([5, 6, 7], SamplingParams(max_tokens=80, ignore_eos=True))
        await gen.__anext__()  # the request is running in the child
        os.kill(engine._proc.pid, signal.SIGKILL)
        async for _ in gen:
            pass

    try:
        with pytest.raises(EngineDeadError, match="exited"):
            asyncio.run(asyncio.wait_for(go(), timeout=60))
        with pytest.raises(EngineDeadError):
            asyncio.run(_all(engine, [[1, 2]], [SamplingParams(max_tokens=2)]))
    finally:
        engine.close()
