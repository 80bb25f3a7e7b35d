"""`samebits rl`'s driver: options checked before any work, the step loop, what is kept on disk.

A run directory holds metrics.jsonl (one row per step, appended), metrics.png (at the
end) and checkpoint.pt. It is never silently reused: a directory that already holds a
run is refused unless the call resumes it or names `overwrite`. The checkpoint is
written every `checkpoint_every` steps, after the last step, after a failing reward
(the step that failed changed nothing, so the state is the last finished step's), and
on SIGINT/SIGTERM, which stop the run after the step in flight.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from samebits.rl import checkpoint
from samebits.rl.config import RLConfig
from samebits.rl.loop import RLLoop
from samebits.rl.rewards import RewardError

CHECKPOINT = "checkpoint.pt"
CHECKPOINT_EVERY = 10  # default interval in steps: a tiny-model step is ~1 s, a 48-layer one ~1 min
RUN_FILES = ("metrics.jsonl", CHECKPOINT, "metrics.png")


class RunStopped(RuntimeError):
    """SIGINT or SIGTERM stopped the run after a finished step; its checkpoint was written."""

    def __init__(self, signum: int, step: int, path: Path | None):
        self.signum, self.step, self.path = signum, step, path
        where = f"checkpoint {path}" if path else "no checkpoint (no out_dir)"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step - 1}; {where}")


def check_options(
    config: RLConfig, resume=None, checkpoint_every: int | None = None, overwrite=False, allow_changes=()
) -> dict | None:
    """Every run option checked before any work (ValueError naming the option) -> the
    resumed checkpoint's state, already loaded as plain data and checked against `config`."""
    if checkpoint_every is None:
        return check_options(config, resume, CHECKPOINT_EVERY, overwrite, allow_changes)
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 0:
        raise ValueError(
            f"--checkpoint-every must be an int >= 0 (0: only at the end), got {checkpoint_every!r}"
        )
    checkpoint.check_allowed_names(tuple(allow_changes))
    if resume is not None and overwrite:
        raise ValueError("--overwrite and --resume together: resuming continues the run's log")
    out = Path(config.out_dir) if config.out_dir else None
    if out is not None:
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out}: exists and is not a directory")
        held = [f for f in RUN_FILES if (out / f).exists()]
        if held and resume is None and not overwrite:
            raise ValueError(
                f"--out {out} already holds a run ({', '.join(held)}): pass --resume "
                f"{out / CHECKPOINT} to continue it, a new --out, or --overwrite to replace it"
            )
    if resume is None:
        return None
    state = checkpoint.load(resume)
    checkpoint.check_config(state["config"], config, tuple(allow_changes))
    return state


def prepare_out(config: RLConfig, overwrite: bool) -> Path | None:
    """Create the run directory (and check it is writable); `overwrite` removes a run's files."""
    if not config.out_dir:
        return None
    out = Path(config.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".samebits-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {out}: not writable ({e.strerror or e})") from e
    if overwrite:
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
    return out


def run(
    config: RLConfig,
    live: bool = True,
    resume: str | Path | None = None,
    checkpoint_every: int | None = None,
    log=print,
    overwrite: bool = False,
    allow_changes: tuple[str, ...] = (),
    parallel=None,
    step_log=None,
) -> list[dict]:
    """Run `config.steps` steps (after `resume`'s step when given) -> one metrics dict per step.

    Checkpoints every `checkpoint_every` steps (None: CHECKPOINT_EVERY; 0: only at the end).

    Raises ValueError (a refused option, before any work), RewardError (after saving the
    last finished step's checkpoint) or RunStopped (SIGINT/SIGTERM, after a checkpoint).
    With `parallel` (a `DataParallel`): every rank steps, rank 0 writes the files, and no
    checkpoint is written (not supported yet). `step_log(row)`: a line per step (rank 0)."""
    from samebits.rl import report

    state = check_options(config, resume, checkpoint_every, overwrite, allow_changes)
    every = CHECKPOINT_EVERY if checkpoint_every is None else checkpoint_every
    writer = parallel is None or parallel.writes()
    out = prepare_out(config, overwrite) if writer else None  # writable before any work
    loop = RLLoop(config, parallel)
    if state is not None:
        loop.restore(state)
        log(f"resumed from {resume} at step {loop.step_count}")
    ckpt = out / CHECKPOINT if out and loop.parallel.supports_checkpoints else None
    title = f"samebits rl: {config.algorithm}, {config.num_prompts}x{config.n} responses, {loop.path.name}"
    view = report.LiveTable(title) if live and writer and sys.stderr.isatty() else None
    rows = []
    try:
        with _stop_signals(enabled=ckpt is not None) as stop:
            for _ in range(config.steps):
                try:
                    row = loop.step()
                except RewardError:
                    if ckpt:
                        loop.save_checkpoint(ckpt)  # the failed step changed nothing
                    raise
                rows.append(row)
                if view:
                    view.add(row)
                if out:
                    report.append_jsonl(out / "metrics.jsonl", row)
                if step_log and writer:
                    log(step_log(row))
                if ckpt and (stop or every and loop.step_count % every == 0):
                    loop.save_checkpoint(ckpt)
                if stop:
                    raise RunStopped(stop[0], loop.step_count, ckpt)
    finally:
        if view:
            view.close()
        loop.close()
    if ckpt:
        loop.save_checkpoint(ckpt)
    if out:
        report.plot(rows, out / "metrics.png")
    return rows


@contextmanager
def _stop_signals(enabled: bool):
    """While inside: SIGINT/SIGTERM append their number to the yielded list instead of
    killing the process, so the loop stops after the step in flight (main thread only)."""
    stop: list[int] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, lambda signum, frame: stop.append(signum))
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
