"""A closed RL loop (GSPO / GRPO) whose rollouts stay bitwise on-policy through every update.

>>> from samebits import rl
>>> rows = rl.run(rl.RLConfig(steps=5))     # tiny model, CPU
>>> rl.passed(rows)                          # 0 mismatches and equal digests at every step
"""

from __future__ import annotations

from samebits.rl.checkpoint import CheckpointError
from samebits.rl.config import RLConfig
from samebits.rl.driver import CHECKPOINT, CHECKPOINT_EVERY, RunStopped, check_options, run
from samebits.rl.loop import RLLoop
from samebits.rl.losses import group_advantages, grpo_losses, gspo_losses
from samebits.rl.parallel import DataParallel, Local, passed
from samebits.rl.rewards import RewardError, hash_reward, load_reward, toy_reward

__all__ = [
    "CHECKPOINT",
    "CHECKPOINT_EVERY",
    "CheckpointError",
    "DataParallel",
    "Local",
    "RLConfig",
    "RLLoop",
    "RewardError",
    "RunStopped",
    "check_options",
    "group_advantages",
    "grpo_losses",
    "gspo_losses",
    "hash_reward",
    "load_reward",
    "passed",
    "run",
    "toy_reward",
]
