"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled.

    temperature 0 is greedy; its reported log-probs are taken at temperature 1.
    top_p / top_k change what is sampled, not the reported log-prob (in the default
    `logprobs_mode`, raw_logprobs), which is `torch.log_softmax(logits.float() / temperature,
    dim=-1)` of the full distribution, temperature a Python float (the trainer's line;
    docs/design.md).
    `seed` makes the request's samples a pure function of (seed, token index), so
    a request gives the same tokens alone, batched, or after preemption; it must be in
    [0, 2**63) (None: the engine draws one). Every field is type-checked: `ignore_eos`
    must be a bool, numbers must be finite, token ids ints (not bools or bytes).

    `n` samples per prompt: sample j is sampled with seed `sample_seed(seed, j)` (sample 0
    with `seed` itself), so the n samples differ and a replay gives the same n.
    `stop` strings end a sample when its detokenized text contains one (trimmed from the
    text, finish_reason "stop"; the token ids keep every sampled token). `logprobs=k` also
    reports the k most likely tokens (ranked by the default log-softmax row), each valued by
    the row's `logprob_formula` and `logprobs_mode` as the sampled token is. `detokenize`
    produces `text` (needs a tokenizer). `prompt_logprobs=k` scores the prompt itself (vLLM's
    field): each prompt token after the first gets the value the row's line gives it at the
    position before, its rank, and that position's k most likely tokens
    (`RequestOutput.prompt_logprobs`; engine/prompt_logprobs.py).

    `logprob_formula`: which trainer's line the sampled token's log-prob is reported by (a
    name in `LOGPROB_FORMULAS`, computed in `numerics.logprob_formulas`, docs/logprobs.md; a
    row function of the logits; or a `FusedLine`, a row function of the hidden states and the
    LM head); None
    takes the engine's (`LLM(..., logprob_formula=)`, default "log_softmax", the line above).

    `logprobs_mode`: what is reported per token, vLLM's names (`LOGPROBS_MODES`,
    docs/logprobs.md): "raw_logprobs" (the line above, untruncated), "processed_logprobs" (the
    log-prob under the truncated, renormalised distribution the token was drawn from, by the
    formula), "raw_logits", "processed_logits"; None takes the engine's (`LLM(logprobs_mode=)`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    n: int = 1
    stop: tuple[str, ...] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    logprob_formula: str | Callable | FusedLine | None = None
    logprobs_mode: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None and hasattr(self.stop, "__iter__"):
            object.__setattr__(self, "stop", tuple(self.stop))
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
        return self._text_problem()

    def _text_problem(self) -> str | None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            return f"n must be an int in [1, {MAX_N}], got {self.n!r}"
        if self.stop is not None and not (
            isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop)
        ):
            return f"stop must be a str or a list of non-empty str, got {self.stop!r}"
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            return f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            return (
                f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"
            )
        if not isinstance(self.detokenize, bool):
            return f"detokenize must be a bool, got {self.detokenize!r}"
        if self.logprob_formula is not None and (problem := logprob_formula_problem(self.logprob_formula)):
            return problem
        if self.logprobs_mode is not None:
            return logprobs_mode_problem(self.logprobs_mode, self.logprob_formula)
        return None


SEED_LIMIT = 2**63  # seeds are 63-bit; a larger one would silently alias a smaller one
MAX_N = 128
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
# the trainers' log-prob lines by name (numerics/logprob_formulas.py computes each; docs/logprobs.md)
LOGPROB_FORMULAS = ("log_softmax", "trl", "trl_selective", "verl", "logsumexp", "cross_entropy")


@dataclass(frozen=True)
class FusedLine:
    """A user's fused log-prob line, for trainers that compute log-probs from the final hidden
    states and the LM head rather than from logits (TRL's fused head, a fused linear
    cross-entropy): `fn(hidden [n, H], lm_head_weight [V, H], ids [n], temperature: float) ->
    log-probs [n]`, hidden and weight in the model's dtype, ids int64. Given as
    `logprob_formula=FusedLine(fn)` (engine-wide or per request); the engine calls `fn` on its
    own final hidden states and LM head (docs/logprobs.md), after checking at construction that
    it is row-invariant (`numerics.logprob_formulas.check_fused_row_invariant`)."""

    fn: Callable

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f"FusedLine takes fn(hidden, lm_head_weight, ids, temperature), got {self.fn!r}")

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


def logprob_formula_problem(formula: object) -> str | None:
    """The problem with `formula` as a message, or None: a name in LOGPROB_FORMULAS, a callable
    or a FusedLine."""
    if callable(formula) or isinstance(formula, FusedLine) or formula in LOGPROB_FORMULAS:
        return None
    return f"logprob_formula must be one of {LOGPROB_FORMULAS}, a callable or a FusedLine, got {formula!r}"


# what is reported per token, vLLM's `logprobs_mode` names (docs/logprobs.md)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


def logprobs_mode_problem(mode: object, formula: object = None) -> str | None:
    """The problem with `mode` (with the row's or engine's `formula`) as a message, or None."""
    if mode not in LOGPROBS_MODES:
        return f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}"
    if mode.endswith("_logits") and formula not in (None, "log_softmax"):
        return (
            f"logprobs_mode={mode!r} reports logits, which no log-prob formula applies to, but "
            f"logprob_formula is {formula!r}: leave logprob_formula at 'log_softmax' (or None), or "
            "use raw_logprobs / processed_logprobs"
        )
    if mode == "processed_logprobs" and (callable(formula) or isinstance(formula, FusedLine)):
        return (
            "logprobs_mode='processed_logprobs' with a row-function logprob_formula is not supported "
            "(a row function is checked on untruncated rows only): use a named formula, or raw_logprobs"
        )
    return None


def sample_seed(seed: int, j: int) -> int:
    """The seed of sample j of a request seeded `seed`: `seed` for j = 0, else the splitmix64
    finaliser of (seed + j * 0x9E3779B97F4A7C15) mod 2**64, keeping the low 63 bits."""
    if j == 0:
        return seed
    z = (seed + j * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


_M64 = (1 << 64) - 1


_MIN_TEMPERATURE = 1e-6  # below this fp32 logits / T overflow; use 0 for greedy


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
