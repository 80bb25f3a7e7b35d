"""Rewards: a callable `fn(prompts, responses) -> list[float]` over token-id lists.

Built in: `toy_reward` (learnable: the fraction of response tokens in a fixed target
subset of the vocabulary, so a policy that learns raises it within a few steps) and
`hash_reward` (deterministic noise: nothing to learn). Any other reward is named as
`module:function` and imported.
"""

from __future__ import annotations

import hashlib
import importlib
import math
from collections.abc import Callable, Sequence

RewardFn = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], Sequence[float]]

TOY_MODULUS = 8  # target tokens: ids divisible by 8 (1/8 of the vocabulary)


class RewardError(RuntimeError):
    """The reward function raised or returned something that is not one finite float per response."""


def toy_reward(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[float]:
    """Fraction of response tokens whose id is a multiple of TOY_MODULUS (0 for an empty response)."""
    return [sum(t % TOY_MODULUS == 0 for t in r) / len(r) if r else 0.0 for r in responses]


def hash_reward(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[float]:
    """A deterministic value in [0, 1) from sha256 of (prompt, response): reproducible noise."""
    out = []
    for p, r in zip(prompts, responses, strict=True):
        digest = hashlib.sha256(repr((list(p), list(r))).encode()).digest()
        out.append(int.from_bytes(digest[:8], "big") / 2**64)
    return out


BUILTIN: dict[str, RewardFn] = {"toy": toy_reward, "hash": hash_reward}


def load_reward(spec: str) -> RewardFn:
    """'toy', 'hash', or 'module:function' (imported); raises ValueError naming what is missing."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward must be 'toy', 'hash' or 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def compute_rewards(name: str, fn: RewardFn, prompts, responses) -> list[float]:
    """Call the reward on copies of the token lists (what it edits is not what the trainer
    trains on) and check it: one finite float per response, else RewardError naming it."""
    prompts, responses = [list(p) for p in prompts], [list(r) for r in responses]
    try:
        values = list(fn(prompts, responses))
    except Exception as e:
        raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e}") from e
    if len(values) != len(responses):
        raise RewardError(f"reward {name!r} returned {len(values)} values for {len(responses)} responses")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise RewardError(f"reward {name!r} returned {v!r} for response {i}: need a finite float")
    return [float(v) for v in values]
