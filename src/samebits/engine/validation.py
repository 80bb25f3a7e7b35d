"""A request's checks before anything is queued, shared by `LLM` and the engine process's
front: every problem is a ValueError naming the request and the field."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from samebits.requests import SamplingParams, as_multimodal


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_request(
    i: int,
    prompt,
    sp: SamplingParams,
    max_model_len: int,
    vocab_size: int,
    tokenize: Callable[[int, str], list[int]],
) -> list[int]:
    """-> request i's prompt token ids, or ValueError naming the field.

    `prompt`: token ids, a str (`tokenize(i, text)` gives its ids) or a multimodal prompt.
    """
    problem = sp.problem()
    if problem:
        raise ValueError(f"request {i}: {problem}")
    try:
        mm = as_multimodal(prompt)
    except ValueError as e:
        raise ValueError(f"request {i}: {e}") from e
    prompt = prompt if mm is None else mm.prompt_token_ids
    ids = tokenize(i, prompt) if isinstance(prompt, str) else prompt
    if isinstance(ids, bytes | bytearray) or not isinstance(ids, Sequence) or not all(map(_is_int, ids)):
        raise ValueError(f"request {i}: prompt must be a list of int token ids or a str")
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError(f"request {i}: prompt is empty")
    if len(ids) + sp.max_tokens > max_model_len:
        raise ValueError(
            f"request {i}: prompt length {len(ids)} + max_tokens {sp.max_tokens} exceeds "
            f"max_model_len {max_model_len}"
        )
    vocab = f"the vocabulary [0, {vocab_size})"
    for t in sp.stop_token_ids or ():
        if not 0 <= t < vocab_size:
            raise ValueError(f"request {i}: stop_token_ids entry {t} is outside {vocab}")
    for pos, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"request {i}: prompt token id {t} at position {pos} is outside {vocab}")
    return ids


def check_text(i: int, params: SamplingParams, tokenizer, path) -> None:
    """ValueError when a request asks for text features the checkpoint cannot give."""
    if params.stop and (not params.detokenize or tokenizer is None):
        why = "detokenize=False" if tokenizer is not None else f"{path} has no tokenizer"
        raise ValueError(f"request {i}: stop strings need detokenized text, but {why}")


def no_tokenizer(i: int, path) -> ValueError:
    return ValueError(f"request {i}: prompt is a str but {path} has no usable tokenizer; pass token ids")
