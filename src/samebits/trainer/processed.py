"""`processed_logprobs`: the engine's `logprobs_mode="processed_logprobs"` values, recomputed
from the trainer's logits (docs/logprobs.md)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from samebits.numerics import truncation
from samebits.numerics.logprob_formulas import FORMULAS
from samebits.numerics.ops import reported_logprobs


def processed_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    formula: str = "log_softmax",
    banned: Sequence[int] = (),
) -> torch.Tensor:
    """The log-prob of each token under the distribution the engine drew it from: logits [n, V]
    (the model's dtype; the rows that predicted the tokens), token_ids [n], the request's
    temperature (0: greedy, read at 1, no truncation), top_p, top_k, logprob formula, and the
    tokens it banned (`banned`: eos before min_tokens, a family's never-sampled ids) -> float32
    [n], bit for bit the engine's `processed_logprobs` under `batch_invariant()`.

    As the sampler: the probabilities of `torch.log_softmax(logits.float() / T)` with the banned
    tokens at 0, top-k then top-p kept (`truncation.keep_rows`), every other token's logit -inf,
    and `formula` on the masked logits at T."""
    if formula not in FORMULAS:
        raise ValueError(f"formula must be one of {FORMULAS}, got {formula!r}")
    keep = kept_tokens(logits, temperature, top_p, top_k, banned)
    n = logits.shape[0]
    return truncation.processed_logprobs_of(logits, token_ids, keep, [temperature] * n, [formula] * n)


def kept_tokens(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1, banned: Sequence[int] = ()
) -> torch.Tensor:
    """The support each row's token was drawn from, as the sampler keeps it: bool [n, V], the
    banned tokens out, then top-k and top-p (none at temperature 0). Its row sums are the
    engine's `num_kept` (`output_token_num_kept` in a served answer) under `batch_invariant()`."""
    n = logits.shape[0]
    t = float(temperature) if temperature > 0 else 1.0
    probs = reported_logprobs(logits, [t] * n).exp()
    keep = torch.ones_like(probs, dtype=torch.bool)
    if banned:
        at = torch.tensor(list(banned), device=logits.device)
        probs[:, at] = 0.0
        keep[:, at] = False
    if temperature > 0 and (top_k != -1 or top_p < 1.0):
        keep &= truncation.keep_rows(probs, [top_k] * n, [top_p] * n)
    return keep
