"""`AsyncEngine`: the engine core in one background thread, requests streamed to asyncio callers.

Any number of coroutines call `generate` at once. Their requests go through an inbox the
engine thread drains between steps, so new requests join the running batch at the next
step and aborts free their KV blocks before it. After every step each touched request's
cumulative `RequestOutput` is handed to its caller's event loop; the last one has every
sample's `finish_reason` set.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future

from samebits.engine.outputs import RequestOutput
from samebits.requests.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread stopped (closed, or an error inside a step)."""


async def outputs(engine, queue: asyncio.Queue, request_id: str) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue until the finished one (an exception put there is
    raised). Leaving early, e.g. a client that went away, aborts the request, unless the
    engine is already closed or dead. Shared by AsyncEngine and EngineProcess."""
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished and engine.error is None and not engine._closed:
            engine.abort(request_id)


class _Stream:
    """One request's outputs, delivered into the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass


class AsyncEngine:
    """Runs `llm.core` in a daemon thread. `close()` stops it (requests in flight are aborted)."""

    def __init__(self, llm):
        self.llm = llm
        self.core = llm.core
        self.core.serving = True
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._streams: dict[str, _Stream] = {}
        self._closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="samebits-engine", daemon=True)
        self._thread.start()

    # -- the caller's side (any event loop, any thread) ------------------------------------

    async def generate(
        self, prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's cumulative outputs as tokens arrive; the last is finished.

        ValueError (naming the field) before the first output when the request is invalid.
        Closing the iterator early (a client that went away) aborts the request.
        """
        stream = _Stream(asyncio.get_running_loop())
        added: Future = Future()
        self._submit(("add", request_id, prompt, params, stream, added))
        try:
            request_id = await asyncio.wrap_future(added)
        except asyncio.CancelledError:  # gone before the engine took it: abort it once added
            added.add_done_callback(self._abort_added)
            raise
        async with contextlib.aclosing(outputs(self, stream.queue, request_id)) as outs:
            async for item in outs:
                yield item

    def validate(self, i: int, prompt, params: SamplingParams) -> list[int]:
        """The checks `generate` will make, run in the caller's thread (read-only): ValueError
        naming request i and the field; -> the prompt's token ids."""
        ids = self.llm._validate(i, prompt, params)
        self.core.check_text(i, params)
        return ids

    def abort(self, request_id: str, group: bool = False) -> None:
        """Abort a request by id (no-op for unknown or finished ones); its stream ends with
        "abort". `group`: also every request whose id is `request_id` + "-<i>" (a prompt list)."""
        self._submit(("abort", request_id, group))

    def _abort_added(self, added: Future) -> None:
        if added.cancelled() or added.exception() is not None:
            return
        try:
            self.abort(added.result())
        except EngineDeadError:
            pass

    def abort_all(self) -> None:
        """Abort every request in flight."""
        self._submit(("abort", None, True))

    def close(self) -> None:
        """Stop the engine thread; requests in flight end with EngineDeadError."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=600)

    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.max_model_len

    def metrics(self) -> dict:
        """The engine's counters now (the names `serve.metrics` exports)."""
        from samebits.engine.engine_child import stats

        return stats(self.llm) | {"requests_in_flight": self.num_in_flight()}

    def _submit(self, command: tuple) -> None:
        with self._cv:
            if self._closed or self.error is not None:
                raise EngineDeadError(f"the engine is not running: {self.error or 'closed'}")
            self._inbox.append(command)
            self._cv.notify()

    # -- the engine thread -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._closed or self.core.has_unfinished()):
                        self._cv.wait()
                    if self._closed:
                        break
                    commands, self._inbox = self._inbox, []
                with self.core.lock:
                    for command in commands:
                        self._handle(command)
                    if self.core.has_unfinished():
                        self._step()
        except BaseException as e:  # noqa: BLE001 - every caller must hear of it
            self.error = e
        self._shutdown()

    def _handle(self, command: tuple) -> None:
        if command[0] == "abort":
            _, rid, group = command
            for request_id in list(self._streams):
                hit = rid is None or request_id == rid or (group and request_id.startswith(f"{rid}-"))
                if hit and self.core.abort(request_id):
                    self._publish(request_id)
            return
        _, request_id, prompt, params, stream, added = command
        if not added.set_running_or_notify_cancel():  # the caller went away first
            return
        try:
            request_id = self.core.add_request(request_id, prompt, params)
        except (ValueError, TypeError, RuntimeError) as e:
            added.set_exception(e)
            return
        self._streams[request_id] = stream
        added.set_result(request_id)

    def _step(self) -> None:
        try:
            done = self.core.step()
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
            self._fail_all(f"a step failed: {e!r}")
            return
        for request_id in done.request_ids:
            self._publish(request_id)

    def _publish(self, request_id: str) -> None:
        stream = self._streams[request_id]
        if self.core.is_finished(request_id):
            stream.put(self.core.pop(request_id))
            del self._streams[request_id]
        else:
            stream.put(self.core.output(request_id))

    def _fail_all(self, message: str) -> None:
        """Every request in flight ends with EngineDeadError(message); the engine stays usable."""
        self.core.abort_all()
        for stream in self._streams.values():
            stream.put(EngineDeadError(message))
        self._streams.clear()

    def _shutdown(self) -> None:
        with self.core.lock:
            self._fail_all(f"the engine stopped: {self.error!r}" if self.error else "the engine was closed")
        self.core.serving = False
        with self._cv:
            self._closed = True
            for command in self._inbox:
                if command[0] == "add" and command[5].set_running_or_notify_cancel():
                    command[5].set_exception(EngineDeadError("the engine was closed"))
            self._inbox.clear()
