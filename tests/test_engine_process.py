"""`EngineProcess`: the engine core in a child process, behind AsyncEngine's interface.

The claims: concurrent requests through the process give `LLM.generate`'s tokens and
float32 log-probs bit for bit (the transport carries float32 -> Python float -> float32,
which is exact; the control shows a lossy transport would be caught); a child that dies
ends every stream with EngineDeadError; a child that cannot build its model raises its
error in the parent; requests an update aborts are sent under the version they ran on.
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


class _Pipe:
    """The child's pipe to the parent, keeping what is sent."""

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def test_a_request_held_behind_a_weight_change_can_be_aborted(tiny):
    """A request that arrives while a weight change waits for the engine to drain is held; an
    abort then ends it at once ("abort", nothing generated) and it never runs. Without the
    abort it runs after the change (control: the same add, not aborted, is queued)."""
    from samebits.engine.engine_child import _Loop

    llm = LLM(tiny, max_num_seqs=2, max_model_len=64)
    pipe = _Pipe()
    loop = _Loop(pipe, llm)
    loop.calls.append((0, "flush_cache", {"_waited": 1}))  # a weight change still waiting
    sp = SamplingParams(max_tokens=4, n=2, seed=1)
    loop._handle(("add", "held", [3, 4, 5], sp))
    loop._handle(("add", "kept", [3, 4, 5], sp))
    assert [c[1] for c in loop.held] == ["held", "kept"] and not llm.core.has_unfinished()
    loop._handle(("abort", "held", False))
    kind, updates, _ = pipe.sent[-1]
    assert kind == "step" and updates == [("held", [([], [], None, "", "abort", None)] * 2, 0, None, [])]
    # the parent's side reads the update (a 5-field sample part failed to unpack there)
    from samebits.engine.engine_process import _Request

    out = _Request("held", [3, 4, 5], sp, None, None).apply(*updates[0][1:3], None, updates[0][4])
    assert out.finished and [o.finish_reason for o in out.outputs] == ["abort", "abort"]
    loop._run_calls_if_idle()  # the change runs, then what was held
    assert llm.core.request_ids() == ["kept"] and pipe.sent[-1][:3] == ("result", 0, True)


def test_requests_an_update_aborts_carry_the_version_they_ran_on(tiny):
    """`abort_all_requests`: the aborted requests' last update is sent before the update runs,
    so it carries the old `weight_version` (their tokens' weights), and the update's answer
    comes after it. Sent later, it would name the new version (tests/test_serve_weight_soak.py
    replays such requests on the version they name)."""
    from samebits.engine.engine_child import _Loop

    llm = LLM(tiny, max_num_seqs=2, max_model_len=64)
    pipe = _Pipe()
    loop = _Loop(pipe, llm)
    loop._handle(("add", "r", [3, 4, 5], SamplingParams(max_tokens=20, seed=1, ignore_eos=True)))
    loop._publish(loop._step() + loop._step())
    assert loop._handle(("call", 0, "flush_cache", {"abort_all_requests": True, "weight_version": "v1"})) == []
    loop._run_calls_if_idle()
    (kind, updates, stats), result = pipe.sent[-2:]
    assert kind == "step" and stats["weight_version"] == "default"
    [(rid, [(ids, _, _, _, finish, _)], _, _, _)] = updates
    assert rid == "r" and finish == "abort" and ids == []  # its 2 tokens went out in the first update
    assert result[:3] == ("result", 0, True) and "1 requests in flight were aborted" in result[3]
    assert loop.weight_version == "v1" and not loop.sent
