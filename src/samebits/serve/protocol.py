"""Request bodies of the HTTP API (pydantic): OpenAI completions and chat, SGLang /generate.

Field names are the OpenAI / vLLM / SGLang ones. Unknown fields are ignored (clients send
defaults for things we do not have); known fields we do not support are refused with 400
when set to anything but their no-op value (vLLM's `min_p` 0, `repetition_penalty` 1.0: a
penalty would change what is sampled and the trainer does not recompute it). `top_k` 0 or -1
is off, as in vLLM. `to_params` maps a body to `SamplingParams`; `logprob_formula` (samebits')
picks the trainer line of the reported log-prob, one of `LOGPROB_FORMULAS`, and `logprobs_mode`
(vLLM's names, `LOGPROBS_MODES`) what is reported, for that request (None: the server's).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from samebits.requests.sampling_params import LOGPROB_FORMULAS, SamplingParams, logprobs_mode_problem

TokenIds = list[StrictInt]


class UnsupportedField(ValueError):
    """A known API field set to a value samebits does not implement."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field


def _check_mode(mode: str | None, formula: str | None) -> None:
    """A request's `logprobs_mode`, refused by name when it is not one of vLLM's or cannot take
    the request's formula."""
    if mode is not None and (why := logprobs_mode_problem(mode, formula)):
        raise UnsupportedField("logprobs_mode", why)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: StrictInt = 1
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    # vLLM extras
    top_k: StrictInt | None = -1  # vLLM: 0, -1 and null all mean off
    min_p: float | None = 0.0
    repetition_penalty: float | None = 1.0
    min_tokens: StrictInt = 0
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # log-prob tokens as "token_id:<id>" (unique keys)
    prompt_logprobs: StrictInt | None = None
    structured_outputs: dict | None = None
    # samebits: which trainer's line reports the sampled token's log-prob, and what is reported
    # (vLLM's logprobs_mode names; None: the server's --logprobs-mode) (docs/logprobs.md)
    logprob_formula: str | None = None
    logprobs_mode: str | None = None
    # OpenAI fields that must stay at their no-op value
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None

    def check_unsupported(self) -> None:
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or an int >= 1, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise UnsupportedField(name, "penalties are not supported (they would change the log-probs)")
        if self.logit_bias:
            raise UnsupportedField("logit_bias", "is not supported")
        if self.min_p not in (None, 0.0):
            why = f"only 0 (off) is supported, got {self.min_p}; send 0 or leave it unset"
            raise UnsupportedField("min_p", why)
        if self.repetition_penalty not in (None, 1.0):
            why = f"only 1.0 (off) is supported, got {self.repetition_penalty}; send 1.0 or leave it unset"
            raise UnsupportedField("repetition_penalty", why)
        if self.structured_outputs:
            raise UnsupportedField("structured_outputs", "is not supported (guided decoding)")
        if self.stream and self.prompt_logprobs:  # vLLM's rule: 0 streams (the prompt tokens alone)
            raise ValueError(
                "prompt_logprobs > 0 is not available with stream=true (as vLLM); send it unstreamed"
            )
        if self.logprob_formula is not None and self.logprob_formula not in LOGPROB_FORMULAS:
            allowed = ", ".join(LOGPROB_FORMULAS)
            raise UnsupportedField(
                "logprob_formula", f"{self.logprob_formula!r} is not a formula; use one of: {allowed}"
            )
        _check_mode(self.logprobs_mode, self.logprob_formula)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def to_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """ValueError naming the field when a value is out of range."""
        self.check_unsupported()
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            n=self.n,
            stop=self.stop or None,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            logprob_formula=self.logprob_formula,
            logprobs_mode=self.logprobs_mode,
        )


class CompletionRequest(_Body):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: StrictInt = 16
    logprobs: StrictInt | None = None
    echo: bool = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        if not p:
            raise ValueError("prompt: is empty")
        return list(p)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise UnsupportedField("echo", "is not supported")
        if self.best_of not in (None, self.n):
            raise UnsupportedField("best_of", "is not supported (use n)")
        if self.suffix:
            raise UnsupportedField("suffix", "is not supported")


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Body):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None

    def max_new(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class SGLangSamplingParams(BaseModel):
    """SGLang's `sampling_params` object."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: StrictInt = 128
    min_new_tokens: StrictInt = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = -1
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    n: StrictInt = 1
    sampling_seed: StrictInt | None = None
    # SGLang's, kept at their no-op values (AReaL sends frequency_penalty)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logprob_formula: str | None = None  # samebits': a trainer's log-prob line by name (docs/logprobs.md)
    logprobs_mode: str | None = None  # samebits': vLLM's logprobs_mode names, per request

    def check_unsupported(self) -> None:
        offs = (("frequency_penalty", 0), ("presence_penalty", 0), ("repetition_penalty", 1), ("min_p", 0))
        for name, off in offs:
            if getattr(self, name) != off:
                why = f"only {off} (off) is supported, got {getattr(self, name)}; send {off} or leave it unset"
                raise UnsupportedField(name, why)
        _check_mode(self.logprobs_mode, self.logprob_formula)


class GenerateRequest(BaseModel):
    """POST /generate (SGLang's native shape); one prompt per call."""

    model_config = ConfigDict(extra="ignore")

    text: str | None = None
    input_ids: TokenIds | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    return_logprob: bool = False
    top_logprobs_num: StrictInt = 0
    stream: bool = False
    rid: str | None = None
    image_data: object = None
    return_routed_experts: bool = False
    logprob_start_len: StrictInt = -1  # SGLang's: -1, no prompt log-probs

    def scores_prompt(self) -> bool:
        """SGLang's `input_token_logprobs`: asked with `return_logprob` and `logprob_start_len` >= 0."""
        return self.return_logprob and self.logprob_start_len >= 0

    def scores_only(self) -> bool:
        """`max_new_tokens: 0` (slime's on-policy-distillation teacher request): the prompt is
        computed and scored, and the response has no tokens. The engine samples one token,
        which the response leaves out."""
        return self.sampling_params.max_new_tokens == 0

    def prompt(self) -> str | list[int]:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text: give exactly one of text and input_ids")
        return self.text if self.text is not None else self.input_ids

    def to_params(self) -> SamplingParams:
        sp = self.sampling_params
        sp.check_unsupported()
        if self.image_data:
            raise UnsupportedField("image_data", "is not supported (text and token ids only)")
        if self.return_routed_experts:
            raise UnsupportedField("return_routed_experts", "is not supported (no routing replay)")
        if self.logprob_start_len < -1:
            raise ValueError(
                f"logprob_start_len must be -1 (no prompt log-probs) or >= 0, got {self.logprob_start_len}"
            )
        return SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            max_tokens=1 if self.scores_only() else sp.max_new_tokens,
            min_tokens=sp.min_new_tokens,
            ignore_eos=sp.ignore_eos,
            seed=sp.sampling_seed,
            stop_token_ids=sp.stop_token_ids,
            n=sp.n,
            stop=sp.stop or None,
            logprobs=self.top_logprobs_num or None,
            prompt_logprobs=self.top_logprobs_num if self.scores_prompt() else None,
            logprob_formula=sp.logprob_formula,
            logprobs_mode=sp.logprobs_mode,
        )


class AbortRequest(BaseModel):
    """POST /abort_request: SGLang's `rid`, or `abort_all`."""

    rid: str = ""
    abort_all: bool = False
