"""SGLang's `/pause_generation` and `/continue_generation`, which AReaL sends to every server
around each weight update (`areal/engine/sglang_remote.py`, bodies `{}`).

- POST /pause_generation {"mode": "abort"} (SGLang's default mode): new generation requests
  are held, every request in flight is aborted (each answer ends with finish reason "abort",
  its tokens so far and the `weight_version` they came from), and the call returns once none
  is left. AReaL then updates the weights and resends each aborted request with its tokens
  appended to the prompt. A weight update meanwhile runs at once: nothing is in flight.
- SGLang's other modes, "retract" and "in_place", keep a request across the update, so its
  tokens would come from two weight versions and no trainer could replay them on one: both
  are refused with a 400 naming `mode`.
- POST /continue_generation: the held requests start, on the weights now loaded.
  `torch_empty_cache` (SGLang's field) is accepted; the engine frees nothing at a pause.

Both are admin endpoints (`auth.py`), as SGLang's `ADMIN_OPTIONAL`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from samebits.serve.errors import ApiError

DRAIN_TIMEOUT_S = 60.0  # the longest a pause waits for the aborted requests to end


class PauseGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    torch_empty_cache: bool = True


class Pause:
    """The gate every generation stream passes before it reaches the engine."""

    def __init__(self, engine):
        self.engine = engine
        self._open = asyncio.Event()
        self._open.set()
        self.streams = 0  # streams past the gate and not yet ended

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def held(self, gen) -> AsyncIterator:
        """`gen`'s outputs, once generation is not paused (a stream waiting here has sent
        nothing to the engine; a client that goes meanwhile leaves no request behind)."""
        try:
            await self._open.wait()
            self.streams += 1
            try:
                async for out in gen:
                    yield out
            finally:
                self.streams -= 1
        finally:
            await gen.aclose()

    async def pause(self) -> None:
        self._open.clear()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.streams or self.engine.num_in_flight():
            if time.monotonic() > deadline:
                left = max(self.streams, self.engine.num_in_flight())
                why = (
                    f"{left} requests were still running {DRAIN_TIMEOUT_S:.0f} s after the abort; "
                    "generation stays paused (send /continue_generation)"
                )
                raise ApiError(503, why, None, "server_error")
            self.engine.abort_all()  # again each time: a stream may have passed the gate just before
            await asyncio.sleep(0.02)

    def resume(self) -> None:
        self._open.set()


def register(app: FastAPI, pause: Pause) -> None:
    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationRequest | None = None):
        mode = (body or PauseGenerationRequest()).mode
        if mode != "abort":
            why = (
                f"mode: {mode!r} keeps requests across the weight update, so one sequence's tokens would "
                "come from two weight versions and no trainer could replay them; send mode 'abort' (the "
                "default) and resend the aborted requests with their tokens, as AReaL does"
            )
            raise ApiError(400, why, "mode")
        await pause.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(body: ContinueGenerationRequest | None = None):
        pause.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}
