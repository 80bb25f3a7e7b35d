"""A closed RL loop (GSPO / GRPO) whose rollouts stay bitwise on-policy through every update.

>>> from samebits import rl
>>> rows = rl.run(rl.RLConfig(steps=5))     # tiny model, CPU
>>> rl.passed(rows)                          # 0 mismatches and equal digests at every step
"""

from __future__ import annotations

import sys
from pathlib import Path

from samebits.rl.config import RLConfig
from samebits.rl.loop import RLLoop
from samebits.rl.losses import group_advantages, grpo_losses, gspo_losses
from samebits.rl.rewards import RewardError, hash_reward, load_reward, toy_reward

CHECKPOINT = "checkpoint.pt"


def run(
    config: RLConfig,
    live: bool = True,
    resume: str | Path | None = None,
    checkpoint_every: int = 0,
    log=print,
) -> list[dict]:
    """Run `config.steps` steps (after `resume`'s step when given); -> one metrics dict per step.

    With `config.out_dir`: metrics.jsonl (appended per step), metrics.png at the end, and
    checkpoint.pt every `checkpoint_every` steps (0: never) and after the last step.
    """
    from samebits.rl import report

    loop = RLLoop(config)
    if resume is not None:
        loop.load_checkpoint(resume)
        log(f"resumed from {resume} at step {loop.step_count}")
    out = Path(config.out_dir) if config.out_dir else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        if resume is None:  # a fresh run starts a fresh log; a resumed one continues it
            (out / "metrics.jsonl").unlink(missing_ok=True)
    title = f"samebits rl: {config.algorithm}, {config.num_prompts}x{config.n} responses, {loop.path.name}"
    view = report.LiveTable(title) if live and sys.stderr.isatty() else None
    rows = []
    try:
        for _ in range(config.steps):
            row = loop.step()
            rows.append(row)
            if view:
                view.add(row)
            if out:
                report.append_jsonl(out / "metrics.jsonl", row)
                if checkpoint_every and loop.step_count % checkpoint_every == 0:
                    loop.save_checkpoint(out / CHECKPOINT)
    finally:
        if view:
            view.close()
    if out:
        loop.save_checkpoint(out / CHECKPOINT)
        report.plot(rows, out / "metrics.png")
    return rows


def passed(rows: list[dict]) -> bool:
    """0 rollout and 0 old-log-prob mismatches and 0 digest differences at every step."""
    keys = ("rollout_logprobs_mismatch_count", "old_logprobs_mismatch_count", "digest_mismatch_count")
    return bool(rows) and all(r[k] == 0 for r in rows for k in keys)


__all__ = [
    "RLConfig",
    "RLLoop",
    "RewardError",
    "group_advantages",
    "grpo_losses",
    "gspo_losses",
    "hash_reward",
    "load_reward",
    "passed",
    "run",
    "toy_reward",
]
