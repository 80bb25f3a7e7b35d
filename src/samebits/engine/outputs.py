"""What the engine hands back: each request's output (`RequestOutput`, one
`CompletionOutput` per sample), what one step did (`StepOutput`) and the counters behind
/metrics (`EngineStats`). Plain dataclasses, filled by the core (engine/core.py) and, for a
core in a child process, by the parent's side of engine/engine_process.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Logprob:
    """One scored token of a prompt position (vLLM's `Logprob`): its float32 value by the
    request's line and its rank in the position's row (1 = most likely; 1 + the number of
    tokens valued strictly higher). `decoded_token` is None: the HTTP layer writes the text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token; the first is None


@dataclass
class CompletionOutput:
    """One sample of a request. `logprobs` is float32, one per generated token;
    `top_logprobs` (when asked with `logprobs=k`) holds k (token, log-prob) pairs per token."""

    index: int
    token_ids: list[int]
    logprobs: torch.Tensor
    text: str
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # processed logprobs modes: per token, how many tokens the distribution it was drawn from
    # kept (its support after bans, top-k and top-p); None in the raw modes
    num_kept: list[int] | None = None


@dataclass
class RequestOutput:
    """One request. The flat fields are sample 0's; `outputs` holds all n samples."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: str | None
    num_preemptions: int = 0
    text: str = ""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    request_id: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    # SGLang's: the `weight_version` of the weights the request ran on (engine process only;
    # a request never spans a weight update there)
    weight_version: str | None = None
    num_kept: list[int] | None = None  # sample 0's (CompletionOutput.num_kept)
    # `SamplingParams.prompt_logprobs=k`: per prompt token, the token itself and the k most
    # likely at its position (engine/prompt_logprobs.py); None for the first token, and when
    # not asked. Filled once the prompt is computed.
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass
class StepOutput:
    """What one step did: the requests some of whose samples gained a token (each once, in
    batch order; their tokens, log-probs and text are on the core: `output`, `progress`)
    and how many samples finished in it."""

    request_ids: list[str]
    num_finished: int


@dataclass
class EngineStats:
    """Counters for /metrics, updated by `step`."""

    generated_tokens: int = 0
    steps: int = 0
    last_step_seconds: float = 0.0
    step_seconds: float = 0.0  # summed over all steps
    aborted_requests: int = 0  # requests abort() stopped before they finished
    last_step_tokens: int = 0
    # prefix sharing, in tokens (vLLM's counters): the tokens of every sequence admitted (or
    # readmitted) with sharing on, and of those, the ones whose K/V came from the cache; the
    # difference is what the admissions computed
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
