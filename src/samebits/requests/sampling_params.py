"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled.

    temperature 0 is greedy; its reported log-probs are taken at temperature 1.
    top_p / top_k change what is sampled, never the reported log-prob, which is
    always `log_softmax(logits.float() / temperature)` of the full distribution.
    `seed` makes the request's samples a pure function of (seed, token index), so
    a request gives the same tokens alone, batched, or after preemption; it must be in
    [0, 2**63) (None: the engine draws one). Every field is type-checked: `ignore_eos`
    must be a bool, numbers must be finite, token ids ints (not bools or bytes).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        stops = self.stop_token_ids
        if stops is not None:
            if isinstance(stops, int | str | bytes) or not hasattr(stops, "__iter__"):
                raise ValueError(f"stop_token_ids must be a list of ints or None, got {stops!r}")
            object.__setattr__(self, "stop_token_ids", tuple(stops))
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """The first invalid field as a message, or None."""
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            return f"temperature must be a number >= 0, got {self.temperature!r}"
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            return f"temperature must be a finite number >= 0, got {self.temperature}"
        if 0 < self.temperature < _MIN_TEMPERATURE:
            return f"temperature must be 0 (greedy) or >= {_MIN_TEMPERATURE}, got {self.temperature}"
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            return f"top_p must be a number in (0, 1], got {self.top_p!r}"
        if not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            return f"top_k must be -1 (off) or an int >= 1, got {self.top_k!r}"
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            return f"max_tokens must be an int >= 1, got {self.max_tokens!r}"
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            return f"min_tokens must be an int >= 0, got {self.min_tokens!r}"
        if self.min_tokens > self.max_tokens:
            return f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT):
            return f"seed must be None or an int in [0, 2**63), got {self.seed!r}"
        if not isinstance(self.ignore_eos, bool):
            return f"ignore_eos must be True or False, got {self.ignore_eos!r}"
        if self.stop_token_ids is not None and not all(_is_int(t) for t in self.stop_token_ids):
            return f"stop_token_ids must be ints, got {self.stop_token_ids!r}"
        return None


SEED_LIMIT = 2**63  # seeds are 63-bit; a larger one would silently alias a smaller one
_MIN_TEMPERATURE = 1e-6  # below this fp32 logits / T overflow; use 0 for greedy


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
