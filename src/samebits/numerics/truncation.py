"""The sampled distribution's support: which tokens top-k and top-p keep, and the log-prob of a
token under the truncated, renormalised distribution (`logprobs_mode="processed_logprobs"`,
docs/logprobs.md).

The engine's sampler (`engine/sampler.py`) and the trainer's `processed_logprobs` both call
`keep_rows`, so a row's kept set is one function of its probabilities: the engine's and the
trainer's are the same wherever their probabilities are the same bits (under
`batch_invariant()`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from samebits.numerics.logprob_formulas import DEFAULT, RowFunction, token_logprobs
from samebits.numerics.registry import pick

Tensor = torch.Tensor

# Top-p sums each row's probabilities as integers: counts of 2**-MASS_BITS of the row's largest
# power of two (`mass`). Integer sums are exact, so a row's cumulative mass, and so its nucleus,
# is the same whatever order a kernel adds in (a batched scan is another kernel than a single
# row's, and may associate differently); the scale follows the row's own largest value, so a
# row left with little mass (its likely tokens banned) is counted as finely as any other.
MASS_BITS = 32  # counts < 2**32 each: a row's sum < V * 2**32 < 2**53 (V < 2**21), exact in float64
NARROW_ROWS = 32  # rows narrowed per pass: bounds the sort's [rows, V] temporaries

Scan = Callable[[Tensor], Tensor]
Put = Callable[[Tensor, torch.device], Tensor]  # a host tensor onto a device


def _cumsum(mass: Tensor) -> Tensor:
    return torch.cumsum(mass, dim=-1)


def _to(t: Tensor, device: torch.device) -> Tensor:
    return t.to(device)


def mass(ordered: Tensor) -> Tensor:
    """Rows [R, V] float32 >= 0 in descending order -> int64 counts: each value times
    2**(MASS_BITS - e), where 2**e bounds the row's largest value (`frexp`), truncated. The
    scale is made from its bits and the product is exact in float64, so each count is a
    function of its row alone; a row of zeros counts 0."""
    exponent = torch.frexp(ordered[:, :1]).exponent.to(torch.int64)  # largest = m * 2**e, m in [0.5, 1)
    scale = ((MASS_BITS - exponent + 1023) << 52).view(torch.float64)  # 2**(MASS_BITS - e), exactly
    return (ordered.double() * scale).to(torch.int64)


def keep_rows(
    probs: Tensor, top_k: Sequence[int], top_p: Sequence[float], one_pass: Callable | None = None
) -> Tensor:
    """Which tokens each row's top-k, then its top-p nucleus, keeps: probs [R, V] float32 >= 0,
    top_k[i] -1 (off) or >= 1, top_p[i] in (0, 1] (1: off) -> bool [R, V].

    top-k keeps the tokens at least the k-th largest probability (ties kept); top-p keeps,
    in descending order, each token whose strictly better tokens' mass is below p times the
    mass top-k left. A row's result depends on its own values only: the k-th largest value
    is one number whichever kernel selects it (`torch.topk` or the sort), the sort is a
    permutation (stable), and the mass is summed in integers (`mass`), exact in any order.
    Rows go in passes of NARROW_ROWS (`one_pass`, default `keep_pass`), a few launches each
    whatever they ask."""
    if probs.shape[0] == 0:
        return torch.zeros(probs.shape, dtype=torch.bool, device=probs.device)
    one_pass = one_pass or keep_pass
    rows = [slice(lo, lo + NARROW_ROWS) for lo in range(0, probs.shape[0], NARROW_ROWS)]
    out = [one_pass(probs[r], top_k[r], top_p[r]) for r in rows]
    return out[0] if len(out) == 1 else torch.cat(out)


def keep_pass(
    probs: Tensor,
    top_k: Sequence[int],
    top_p: Sequence[float],
    scan: Scan = _cumsum,
    put: Put = _to,
    count: Scan = mass,
) -> Tensor:
    """`keep_rows` of at most NARROW_ROWS rows. `scan`: the inclusive scan of the counts;
    `put`: how host tensors reach the device; `count`: the counts (`mass`)."""
    vocab = probs.shape[-1]
    ks = [vocab if k == -1 else min(k, vocab) for k in top_k]
    kth_at = put(torch.tensor(ks, dtype=torch.int64)[:, None] - 1, probs.device)
    if all(p >= 1.0 for p in top_p):  # top-k only: its k-th value, no full sort
        kth = torch.topk(probs, max(ks), dim=-1).values.gather(1, kth_at)
        return probs >= kth
    ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    kth = ordered.gather(1, kth_at)
    counts = count(torch.where(ordered >= kth, ordered, 0.0))  # what top-k leaves, in order
    through = scan(counts)
    before = (through - counts).double()  # < 2**53 (MASS_BITS): exact
    p = put(torch.tensor(list(top_p), dtype=torch.float64)[:, None], probs.device)
    keep_ordered = (before < p * through[:, -1:].double()) | (p >= 1.0)
    keep = torch.empty_like(keep_ordered).scatter_(1, order, keep_ordered)
    return keep & (probs >= kth)


def masked_logits(logits: Tensor, keep: Tensor) -> Tensor:
    """logits [N, V] (their dtype) with every token outside `keep` at -inf: the truncated
    distribution, which each line then renormalises by its own reduction."""
    return logits.masked_fill(~keep, float("-inf"))


def processed_logprobs_of(
    logits: Tensor,
    ids: Tensor,
    keep: Tensor,
    temperatures: Sequence[float],
    formulas: Sequence[str | RowFunction | None],
) -> Tensor:
    """The log-prob of each row's token under its truncated, renormalised distribution: the
    row's formula (None: the default line) on `masked_logits(logits, keep)`, at its temperature
    (0, greedy: 1) -> float32 [N]."""
    lines = [DEFAULT if f is None else f for f in formulas]
    return token_logprobs(masked_logits(logits, keep), ids, temperatures, lines)


def processed_logits_rows(logits: Tensor, keep: Tensor, temps: Tensor) -> Tensor:
    """logits [N, V], keep [N, V], temps [N] float32 (greedy rows 1) -> the temperature-scaled
    logits the rows were sampled from, float32, -inf outside `keep` (vLLM's processed logits;
    the scaling is the sampler's, `registry.temperature_scale`)."""
    scaled = pick("temperature_scale", logits.device.type)(logits.float(), temps)
    return scaled.masked_fill(~keep, float("-inf"))
