"""`EngineProcess`: the engine core in a process of its own, streamed to asyncio callers.

The HTTP server's own Python work (parsing, formatting, SSE) shares an interpreter lock with
whatever runs in its process. With the engine in a thread there, each step's host work
waited behind the formatting of the last step's chunks (measured on the H200, 48 layers, 64
streaming requests: 1.45x the offline time). vLLM's and SGLang's servers keep their engine
loops in other processes for this reason, and so does this one.

The child process builds `LLM(**llm_kwargs)` and loops: take the commands that arrived
(add, abort, close), run one step, send what each touched request gained (token ids,
float32 log-probs as Python floats, top-k lists, text, finish reasons) and the counters for
/metrics. The parent checks every request before it is sent (the same checks as `LLM`),
keeps each request's cumulative `RequestOutput`, and hands it to the caller's event loop,
one wake-up per loop per step. Two parent threads own the pipe: a writer sends the queued
commands (so an event loop never waits while the child is inside a step with the pipe
full), a reader takes the child's updates. A request's tokens and log-probs are the engine core's, so
they are what `LLM.generate` gives for the same request, bit for bit.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import torch

from samebits.engine.async_engine import EngineDeadError, outputs
from samebits.engine.detokenizer import load_tokenizer
from samebits.engine.outputs import CompletionOutput, RequestOutput
from samebits.engine.prompt_logprobs import as_logprobs
from samebits.engine.validation import check_request, check_text, no_tokenizer
from samebits.requests.sampling_params import SamplingParams

_ERRORS = {
    "ValueError": ValueError,
    "OSError": OSError,
    "FileNotFoundError": FileNotFoundError,
    "TypeError": TypeError,
    "KeyError": KeyError,
    "ConnectionError": ConnectionError,
    "RuntimeError": RuntimeError,
}
START_TIMEOUT = 1800  # seconds for the child to load the model (a 60 GB checkpoint, graphs)


class _Request:
    """The parent's view of one request: cumulative samples, its caller's queue."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, loop, queue):
        self.request_id, self.prompt_ids, self.loop, self.queue = request_id, prompt_ids, loop, queue
        n, k = params.n, params.logprobs
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.lps: list[list[float]] = [[] for _ in range(n)]
        self.tops: list[list] | None = [[] for _ in range(n)] if k else None
        self.kept: list[list[int]] | None = None  # the processed modes' num_kept, when sent
        self.text, self.finish = [""] * n, [None] * n
        self.preemptions = 0
        self.weight_version: str | None = None
        # `prompt_logprobs`: the scored positions so far (None once built into prompt_logprobs)
        self.scores: list | None = [] if params.prompt_logprobs is not None else None
        self.prompt_logprobs = None

    def apply(
        self, parts: list[tuple], preemptions: int, weight_version: str | None, scores=()
    ) -> RequestOutput:
        if scores:
            self.scores += scores
        for j, (ids, lps, tops, text, finish, kept) in enumerate(parts):
            self.ids[j] += ids
            self.lps[j] += lps
            if self.tops is not None:
                self.tops[j] += tops
            if kept is not None:
                self.kept = self.kept or [[] for _ in self.ids]
                self.kept[j] += kept
            self.text[j], self.finish[j] = text, finish
        self.preemptions = preemptions
        self.weight_version = weight_version
        return self.output()

    def output(self) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=j,
                token_ids=list(self.ids[j]),
                logprobs=torch.tensor(self.lps[j], dtype=torch.float32),  # float32 -> float -> same float32
                text=self.text[j],
                finish_reason=self.finish[j],
                top_logprobs=list(self.tops[j]) if self.tops is not None else None,
                num_kept=list(self.kept[j]) if self.kept is not None else None,
            )
            for j in range(len(self.ids))
        ]
        first = outs[0]
        return RequestOutput(
            index=0,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=first.token_ids,
            logprobs=first.logprobs,
            finish_reason=first.finish_reason,
            num_preemptions=self.preemptions,
            text=first.text,
            top_logprobs=first.top_logprobs,
            request_id=self.request_id,
            outputs=outs,
            weight_version=self.weight_version,
            num_kept=first.num_kept,
            prompt_logprobs=self._prompt_logprobs(),
        )

    def _prompt_logprobs(self):
        """As vLLM gives them, once the whole prompt is scored (built once)."""
        if self.scores is not None and len(self.scores) >= len(self.prompt_ids) - 1:
            self.scores, self.prompt_logprobs = None, as_logprobs(self.scores)
        return self.prompt_logprobs


class EngineProcess:
    """`LLM(**llm_kwargs)` in a child process behind `AsyncEngine`'s interface (`generate`,
    `validate`, `abort`, `abort_all`, `close`, `metrics`, `error`). Raises what the child
    raised (ValueError, OSError) when the model cannot be built."""

    def __init__(self, llm_kwargs: dict):
        from samebits.engine import engine_child

        ctx = multiprocessing.get_context("spawn")  # the child owns the GPU; the parent never touches CUDA
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=engine_child.main, args=(child, llm_kwargs), name="samebits-engine")
        self._proc.daemon = True
        self._proc.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start within {START_TIMEOUT} s")
        try:
            kind, facts = self._conn.recv()
        except EOFError:
            self._proc.join(timeout=30)
            raise RuntimeError(f"the engine process exited ({self._proc.exitcode}) while starting") from None
        if kind == "failed":
            self._proc.join(timeout=30)
            name, message = facts
            raise _ERRORS.get(name, RuntimeError)(message)
        self.path = Path(facts["path"])
        self.max_model_len, self.vocab_size = facts["max_model_len"], facts["vocab_size"]
        self.device = facts["device"]  # the engine's own, e.g. "cuda:0" (vllm_api reads it)
        self._stats: dict = facts["stats"]
        self.tokenizer = load_tokenizer(self.path)
        self.error: BaseException | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # commands, sent by the writer thread
        self._lock = threading.Lock()  # guards _requests (event loops add, the reader finishes)
        self._requests: dict[str, _Request] = {}
        self._calls: dict[int, tuple] = {}  # call id -> (event loop, future), guarded by _lock
        self._call_ids = itertools.count()
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="samebits-engine-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="samebits-engine-writer", daemon=True)
        self._writer.start()

    # -- the caller's side ---------------------------------------------------------------

    def validate(self, i: int, prompt, params: SamplingParams) -> list[int]:
        """The checks `generate` relies on (ValueError naming request i and the field)."""
        ids = check_request(i, prompt, params, self.max_model_len, self.vocab_size, self._tokenize)
        check_text(i, params, self.tokenizer, self.path)
        return ids

    def _tokenize(self, i: int, text: str) -> list[int]:
        if self.tokenizer is None:
            raise no_tokenizer(i, self.path)
        return self.tokenizer(text)["input_ids"]

    async def generate(
        self, prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's cumulative outputs; the last one is finished. ValueError
        (naming the field) before the first output when the request is invalid. Closing the
        iterator early (a client that went away) aborts the request."""
        ids = self.validate(0, prompt, params)
        request_id = f"req-{uuid.uuid4().hex}" if request_id is None else str(request_id)
        req = _Request(request_id, ids, params, asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._requests[request_id] = req
        try:
            self._send(("add", request_id, ids, params))
        except EngineDeadError:
            with self._lock:
                self._requests.pop(request_id, None)
            raise
        async with contextlib.aclosing(outputs(self, req.queue, request_id)) as outs:
            async for item in outs:
                yield item

    def abort(self, request_id: str, group: bool = False) -> None:
        """Abort a request (no-op for unknown or finished ones); its stream ends with "abort".
        `group`: also every request whose id is `request_id` + "-<i>" (a prompt list)."""
        self._send(("abort", request_id, group))

    def abort_all(self) -> None:
        self._send(("abort", None, True))

    async def call(self, method: str, **kwargs):
        """Run an engine operation in the child (`engine_child.IMMEDIATE` / `WAIT_IDLE`: weight
        sync, digests, memory release) and return its value; raises what it raised (ValueError,
        KeyError, ConnectionError, RuntimeError) with the child's message."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = (loop, future)
        try:
            self._send(("call", call_id, method, kwargs))
        except EngineDeadError:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        return await future

    def num_in_flight(self) -> int:
        return len(self._requests)

    def metrics(self) -> dict:
        """The engine's counters as of its last step (see `engine_child.stats`)."""
        return dict(self._stats, requests_in_flight=len(self._requests))

    def close(self) -> None:
        """Stop the child (requests in flight end with EngineDeadError) and wait for it."""
        if not self._closed:
            self._closed = True
            try:
                self._send(("close",))
            except EngineDeadError:
                pass
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=30)
        self._outbox.put(None)  # the writer stops (if the close did not already stop it)
        self._writer.join(timeout=30)
        self._reader.join(timeout=30)

    def _send(self, command: tuple) -> None:
        """Queue a command for the child. Never blocks the caller's event loop: while the
        child is inside a step the pipe may be full, and only the writer thread waits."""
        if self.error is not None:
            raise EngineDeadError(f"the engine is not running: {self.error}")
        self._outbox.put(command)

    def _write(self) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                self._conn.send(command)
            except (OSError, ValueError):  # the child is gone: the reader sees EOF and fails every stream
                return
            if command[0] == "close":
                return

    # -- the reader thread ---------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                kind, *payload = self._conn.recv()
                if kind == "step":
                    self._deliver(*payload)
                elif kind == "result":
                    self._resolve(*payload)
                elif kind == "rejected":  # the child refused an add (e.g. larger than the cache)
                    self._fail(payload[0], ValueError(payload[1]))
                elif kind == "closed":
                    self.error = EngineDeadError("the engine was closed")
                    break
                elif kind == "died":
                    self.error = EngineDeadError(f"the engine stopped: {payload[0]}")
                    break
        except (EOFError, OSError) as e:
            self.error = EngineDeadError(f"the engine process exited ({self._proc.exitcode}): {e!r}")
        with self._lock:
            requests, self._requests = list(self._requests.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        self._wake([(r, self.error) for r in requests])
        for loop, future in calls:
            _settle(loop, future, False, self.error)

    def _resolve(self, call_id: int, ok: bool, value) -> None:
        with self._lock:
            loop, future = self._calls.pop(call_id)
        if not ok:
            name, message = value
            value = _ERRORS.get(name, RuntimeError)(message)
        _settle(loop, future, ok, value)

    def _deliver(self, updates: list[tuple], stats: dict) -> None:
        self._stats = stats
        items = []
        with self._lock:
            for request_id, parts, preemptions, failed, scores in updates:
                req = self._requests.get(request_id)
                if req is None:
                    continue
                if failed is not None:  # a step failed: its requests fail, the engine goes on
                    item = EngineDeadError(failed)
                else:
                    item = req.apply(parts, preemptions, stats.get("weight_version"), scores)
                if failed is not None or item.finished:
                    del self._requests[request_id]
                items.append((req, item))
        self._wake(items)

    def _fail(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            req = self._requests.pop(request_id, None)
        if req is not None:
            self._wake([(req, error)])

    @staticmethod
    def _wake(items: list[tuple]) -> None:
        """One call into each event loop for all of its requests' new items."""
        by_loop: dict = {}
        for req, item in items:
            by_loop.setdefault(req.loop, []).append((req.queue, item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass


def _put_all(puts: list) -> None:
    for q, item in puts:
        q.put_nowait(item)


def _settle(loop, future, ok: bool, value) -> None:
    """Resolve `future` on its own event loop (from the reader thread)."""

    def settle() -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # that event loop is closed: nobody is waiting
        pass
