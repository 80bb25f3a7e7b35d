"""The engine process's loop (see `engine_process`): commands in, one step, updates out.

Messages to the parent: ("ready", facts) or ("failed", (exception type, message)) once;
then ("step", updates, stats) after every step or abort that touched requests, where an
update is (request id, per-sample parts, sample 0's preemptions, None) or (request id,
None, 0, message) when a step failed; ("rejected", request id, message) for an add the
core refused; ("closed",) or ("died", message) last.
"""

from __future__ import annotations

import traceback


def main(conn, llm_kwargs: dict) -> None:
    try:
        from samebits.engine.llm import LLM

        llm = LLM(**llm_kwargs)
    except BaseException as e:  # noqa: BLE001 - the parent re-raises it
        conn.send(("failed", (type(e).__name__, str(e))))
        return
    core = llm.core
    core.serving = True
    facts = {
        "path": str(llm.path),
        "max_model_len": llm.engine.max_model_len,
        "vocab_size": llm.config.vocab_size,
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
        "last_step_seconds": s.last_step_seconds,
    }


class _Loop:
    def __init__(self, conn, llm):
        self.conn, self.llm, self.core = conn, llm, llm.core
        self.sent: dict[str, list[int]] = {}  # request id -> tokens already sent, per sample

    def run(self) -> None:
        with self.llm.runner.profile.context():
            while True:
                touched: list[str] = []
                busy = self.core.has_unfinished()
                while not busy or self.conn.poll(0):  # block for a command only when idle
                    command = self.conn.recv()
                    if command[0] == "close":
                        self.core.abort_all()
                        self.conn.send(("closed",))
                        return
                    touched += self._handle(command)
                    busy = self.core.has_unfinished()
                    if not busy and touched:
                        break
                if busy:
                    touched += self._step()
                if touched:
                    self._publish(touched)

    def _handle(self, command: tuple) -> list[str]:
        if command[0] == "abort":
            _, rid, group = command
            hits = [r for r in self.sent if rid is None or r == rid or (group and r.startswith(f"{rid}-"))]
            return [r for r in hits if self.core.abort(r)]
        _, request_id, ids, params = command
        try:
            self.core.add_validated(request_id, 0, ids, params)
        except (ValueError, TypeError, RuntimeError) as e:
            self.conn.send(("rejected", request_id, str(e)))
            return []
        self.sent[request_id] = [0] * params.n
        return []

    def _step(self) -> list[str]:
        try:
            deltas = self.core.step()
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
            failed = [(r, None, 0, f"a step failed: {e!r}") for r in self.sent]
            self.core.abort_all()
            self.sent.clear()
            self.conn.send(("step", failed, stats(self.llm)))
            return []
        return list(dict.fromkeys(d.request_id for d in deltas))

    def _publish(self, touched: list[str]) -> None:
        updates = []
        for request_id in dict.fromkeys(touched):
            parts, preemptions = self.core.progress(request_id, self.sent[request_id])
            updates.append((request_id, parts, preemptions, None))
            if self.core.is_finished(request_id):
                self.core.pop(request_id)
                del self.sent[request_id]
        self.conn.send(("step", updates, stats(self.llm)))
