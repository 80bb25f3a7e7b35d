"""The engine process's loop (see `engine_process`): commands in, one step, updates out.

Messages to the parent: ("ready", facts) or ("failed", (exception type, message)) once;
then ("step", updates, stats) after every step or abort that touched requests, where an
update is (request id, per-sample parts, sample 0's preemptions, None, the prompt positions
scored since the last update) or (request id, None, 0, message, []) when a step failed;
("rejected", request id, message) for an add the core refused; ("result", call id, ok,
value or (error type, message)) for a call;
("closed",) or ("died", message) last.

Calls (`EngineProcess.call`) are the weight and memory operations of `weights.receiver`
and `LLM`. Those in `WAIT_IDLE` change what a step computes, so they run only when no
request is in flight: requests already running finish on the old weights, requests that
arrive meanwhile are held and start after the call (SGLang's order); with
`abort_all_requests` the running ones are aborted instead (finish reason "abort"), their last
update sent before the call runs, so it carries the `weight_version` their tokens came from.
Their checks that need no data run at once (`PRECHECK`), so a bad update answers at once.
vLLM's /finish_weight_update closes its update on arrival, so an update opened after it is
not the one it applies.
"""

from __future__ import annotations

import gc
import threading
import traceback
from collections import deque

from samebits.weights.receiver import WeightReceiver
from samebits.weights.vllm_receiver import VllmReceiver

IMMEDIATE = (
    "init_weights_update_group",
    "destroy_weights_update_group",
    "weight_digests",
    "weight_specs",
    "get_weight_version",
    # vLLM's (weights.vllm_receiver): receiving stages, and changes nothing a step computes
    "init_transfer_engine",
    "start_weight_update",
    "receive_weights",
)
WAIT_IDLE = (
    "update_weights_from_distributed",
    "update_weights_from_tensor",
    "update_weights_from_disk",
    "release_memory_occupation",
    "resume_memory_occupation",
    "flush_cache",
    "finish_weight_update",
)
# touch no engine state until the group or communicator exists
IN_THREAD = ("init_weights_update_group", "init_transfer_engine")
# run on arrival; a check that returns a dict hands it on to the call as arguments
PRECHECK = {
    "update_weights_from_distributed": "check_distributed",
    "finish_weight_update": "close_weight_update",  # -> {"staged": ...}: the update it closed
}


def main(conn, llm_kwargs: dict) -> None:
    try:
        from samebits.engine.llm import LLM

        llm = LLM(**llm_kwargs)
    except BaseException as e:  # noqa: BLE001 - the parent re-raises it
        conn.send(("failed", (type(e).__name__, str(e))))
        return
    core = llm.core
    core.serving = True
    # the model's objects live as long as the process: keep them out of every later collection
    # (a full pass over them took 40-100 ms, landing inside a step every few hundred steps)
    gc.collect()
    gc.freeze()
    facts = {
        "path": str(llm.path),
        "max_model_len": llm.engine.max_model_len,
        "vocab_size": llm.config.vocab_size,
        "device": str(llm.runner.device),
    }
    conn.send(("ready", facts | {"stats": stats(llm)}))
    try:
        _Loop(conn, llm).run()
    except (EOFError, OSError, KeyboardInterrupt):  # the parent went away
        return
    except BaseException:  # noqa: BLE001 - tell the parent what killed the engine
        conn.send(("died", traceback.format_exc(limit=5)))


def stats(llm) -> dict:
    """Counters for /metrics (names as `serve.metrics` exports them)."""
    sched, blocks, s = llm.scheduler, llm.block_manager, llm.core.stats
    return {
        "num_requests_running": len(sched.running),
        "num_requests_waiting": len(sched.waiting),
        "kv_blocks_used": blocks.num_blocks - blocks.num_free_blocks,
        "kv_blocks_total": blocks.num_blocks,
        "generation_tokens": s.generated_tokens,
        "aborted_requests": s.aborted_requests,
        "num_preemptions": sched.num_preemptions,
        "engine_steps": s.steps,
        "engine_step_seconds": s.step_seconds,
        "prefix_cache_queries": s.prefix_cache_queries,
        "prefix_cache_hits": s.prefix_cache_hits,
        "last_step_seconds": s.last_step_seconds,
    }


class _Loop:
    def __init__(self, conn, llm):
        self.conn, self.llm, self.core = conn, llm, llm.core
        self.sent: dict[str, list[int]] = {}  # request id -> tokens already sent, per sample
        self.receiver = WeightReceiver(llm)
        self.vllm = VllmReceiver(llm)
        self.send_lock = threading.Lock()
        self.calls: deque[tuple] = deque()  # WAIT_IDLE calls waiting for the engine to drain
        self.held: list[tuple] = []  # adds that arrived behind them
        self.weight_version = "default"  # SGLang's name for weights nobody versioned

    def run(self) -> None:
        with self.llm.runner.profile.context():
            while True:
                touched: list[str] = []
                while True:
                    touched += self._run_calls_if_idle()
                    busy = self.core.has_unfinished()
                    if (busy and not self.conn.poll(0)) or (not busy and touched):
                        break
                    command = self.conn.recv()  # blocks only when idle
                    if command[0] == "close":
                        self.core.abort_all()
                        self._send(("closed",))
                        return
                    touched += self._handle(command)
                if busy:
                    touched += self._step()
                if touched:
                    self._publish(touched)

    def _handle(self, command: tuple) -> list[str]:
        if command[0] == "call":
            return self._call(*command[1:])
        if command[0] == "add" and self.calls:  # after the pending weight change
            self.held.append(command)
            return []
        if command[0] == "abort":
            _, rid, group = command

            def hit(r: str) -> bool:
                return rid is None or r == rid or (group and r.startswith(f"{rid}-"))

            self._abort_held([c for c in self.held if hit(c[1])])
            return [r for r in self.sent if hit(r) and self.core.abort(r)]
        _, request_id, ids, params = command
        try:
            self.core.add_validated(request_id, 0, ids, params)
        except (ValueError, TypeError, RuntimeError) as e:
            self._send(("rejected", request_id, str(e)))
            return []
        self.sent[request_id] = [0] * params.n
        return []

    def _abort_held(self, adds: list[tuple]) -> None:
        """Aborted before they started (held behind a weight change): they end now, empty."""
        if not adds:
            return
        gone = {c[1] for c in adds}
        self.held = [c for c in self.held if c[1] not in gone]
        updates = []
        for _, request_id, _, params in adds:
            part = ([], [], [] if params.logprobs else None, "", "abort", None)
            updates.append((request_id, [part] * params.n, 0, None, []))
        self._send(("step", updates, self._stats()))

    def _call(self, call_id: int, method: str, kwargs: dict) -> list[str]:
        if method not in IMMEDIATE + WAIT_IDLE:
            self._reply(call_id, False, ("ValueError", f"unknown engine call {method!r}"))
            return []
        if method in IN_THREAD:  # a rendezvous may wait long (a trainer that never joins): keep stepping
            threading.Thread(target=self._run_call, args=(call_id, method, kwargs), daemon=True).start()
            return []
        if method in IMMEDIATE:
            self._run_call(call_id, method, kwargs)
            return []
        if method in PRECHECK:
            try:
                found = getattr(self._target(PRECHECK[method]), PRECHECK[method])(**kwargs)
            except Exception as e:  # noqa: BLE001 - refused before waiting on anything
                self._reply(call_id, False, (type(e).__name__, _message(e)))
                return []
            if isinstance(found, dict):
                kwargs = kwargs | found
        in_flight = len(self.sent)
        self.calls.append((call_id, method, kwargs | {"_waited": in_flight}))
        if kwargs.get("abort_all_requests"):
            # published now, under the version their tokens came from: the call may run as soon
            # as the loop looks again, and what it then publishes carries the new version
            aborted = [r for r in list(self.sent) if self.core.abort(r)]
            if aborted:
                self._publish(aborted)
        return []

    def _run_calls_if_idle(self) -> list[str]:
        """Run the pending WAIT_IDLE calls once nothing is in flight, then the held adds."""
        if not self.calls or self.core.has_unfinished():
            return []
        while self.calls:
            self._run_call(*self.calls.popleft())
        held, self.held = self.held, []
        for command in held:
            self._handle(command)
        return []

    def _run_call(self, call_id: int, method: str, kwargs: dict) -> None:
        waited = kwargs.pop("_waited", 0)
        aborted = kwargs.pop("abort_all_requests", False)
        version = kwargs.pop("weight_version", None)
        if method == "get_weight_version":
            self._reply(call_id, True, {"weight_version": self.weight_version})
            return
        try:
            value = getattr(self._target(method), method)(**kwargs)
        except Exception as e:  # noqa: BLE001 - the caller gets it; the engine goes on
            self._reply(call_id, False, (type(e).__name__, _message(e)))
            return
        if version is not None:  # SGLang's: the version the trainer gave its weights
            self.weight_version = version
        if waited and isinstance(value, str | None):  # say what happened to the requests in flight
            how = "were aborted" if aborted else "finished on the old weights first"
            value = f"{value or 'done'} ({waited} requests in flight {how})"
        self._reply(call_id, True, value)

    def _target(self, method: str):
        """Who runs `method`: SGLang's receiver, vLLM's, or the LLM."""
        return next((t for t in (self.receiver, self.vllm) if hasattr(t, method)), self.llm)

    def _reply(self, call_id: int, ok: bool, value) -> None:
        self._send(("result", call_id, ok, value))

    def _send(self, message: tuple) -> None:
        with self.send_lock:  # the loop and a group-joining thread both answer
            self.conn.send(message)

    def _step(self) -> list[str]:
        try:
            done = self.core.step()
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
            failed = [(r, None, 0, f"a step failed: {e!r}", []) for r in self.sent]
            self.core.abort_all()
            self.sent.clear()
            self._send(("step", failed, self._stats()))
            return []
        return done.request_ids

    def _publish(self, touched: list[str]) -> None:
        updates = []
        for request_id in dict.fromkeys(touched):
            parts, preemptions, scores = self.core.progress(request_id, self.sent[request_id])
            updates.append((request_id, parts, preemptions, None, scores))
            if self.core.is_finished(request_id):
                self.core.pop(request_id)
                del self.sent[request_id]
        self._send(("step", updates, self._stats()))

    def _stats(self) -> dict:
        return stats(self.llm) | {"weight_version": self.weight_version}


def _message(e: BaseException) -> str:
    """A KeyError's message without the repr quotes around it."""
    return e.args[0] if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str) else str(e)
