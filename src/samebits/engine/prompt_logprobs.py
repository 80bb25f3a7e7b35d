"""Scoring the prompt itself: `SamplingParams.prompt_logprobs=k` (vLLM's field).

A prompt of P tokens has P - 1 scored positions. The hidden row at position p gives the
value of token p + 1 by the request's own line: the formula, `logprobs_mode` and temperature
its sampled tokens are reported by (`sampler`; greedy reads as T = 1). So a trainer that
recomputes the whole sequence reads the same bits at every prompt token as at every sampled
one, and a teacher scored through this engine (TRL's `VLLMClient.get_sequence_logprobs`,
distillation) is scored at the temperature the request names. Unlike vLLM's, whose prompt
log-probs ignore the temperature, the value is the row's line at T. The processed modes have
no truncated distribution at a prompt position (nothing was drawn there): they report the
untruncated line, as raw_logprobs does; the logits modes report the logits (processed_logits:
divided by T, as the sampler scales them).

Each position also carries its token's rank in the row (1 + the tokens valued strictly
higher, vLLM's `rank`) and the k most likely tokens, ranked as `logprobs=k` ranks (the default
log-softmax row at T, a stable descending sort: ties go to the lower id), each valued by the
line in the same call as the prompt token.

The runner scores in the eager step that computes those positions, `ROWS` rows of logits at a
time (`[ROWS, V]` float32 stays small beside the KV cache), and waits for them there: a rare
feature, not worth a second copy path. Only the first sample of a request scores (the n
samples share the prompt). A request that asks reads no K/V from the prefix cache (vLLM's
`skip_reading_prefix_cache`), since every position must be computed; after a preemption the
positions already scored are not scored again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from samebits.engine.outputs import Logprob, PromptLogprobs
from samebits.engine.scheduler import ScheduledBatch, ScheduledChunk
from samebits.model.host_copy import to_device
from samebits.numerics.logprob_formulas import DEFAULT, token_logprobs
from samebits.numerics.ops import reported_logprobs
from samebits.numerics.registry import pick
from samebits.requests import SamplingParams

ROWS = 64  # logits rows scored at once: with the sort, ~18 bytes a vocabulary entry: 175 MB at 151936


class PromptScore(NamedTuple):
    """One scored prompt position: the next prompt token, its value and rank, and the row's
    k most likely tokens with their values."""

    token: int
    value: float
    rank: int
    top: list[tuple[int, float]]


def span(chunk: ScheduledChunk) -> tuple[int, int] | None:
    """The positions [lo, hi) of chunk that score a prompt token not scored yet, or None."""
    seq = chunk.seq
    if seq.prompt_scores is None:
        return None
    lo = max(chunk.start, seq.num_prompt_scored)
    hi = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)
    return (lo, hi) if lo < hi else None


def score_batch(model, hidden: torch.Tensor, batch: ScheduledBatch) -> None:
    """Score the prompt positions this step computed (hidden [T, H], the chunks' rows in
    order): each asking sequence's `prompt_scores` grows by its new positions, in order."""
    if not any([c.seq.prompt_scores is not None for c in batch.chunks]):
        return
    offset = 0
    for c in batch.chunks:
        where = span(c)
        if where is not None:
            lo, hi = where
            seq = c.seq
            for a in range(lo, hi, ROWS):
                b = min(a + ROWS, hi)
                rows = hidden[offset + a - c.start : offset + b - c.start]
                seq.prompt_scores += score_rows(model, rows, seq.token_ids[a + 1 : b + 1], seq.params)
            seq.num_prompt_scored = hi
        offset += c.num_tokens


def score_rows(model, rows: torch.Tensor, targets: list[int], params: SamplingParams) -> list[PromptScore]:
    """hidden rows [n, H] -> the `PromptScore` of each target token (targets[i] follows row i)."""
    n, k = len(targets), params.prompt_logprobs or 0
    logits = model.compute_logits(rows)  # [n, V]
    t = params.temperature if params.temperature > 0 else 1.0
    temps = torch.full((n,), t, dtype=torch.float32, device=logits.device)
    mode = params.logprobs_mode or "raw_logprobs"
    if mode.endswith("logits"):
        ranked = logits.float()
        if mode == "processed_logits":
            ranked = pick("temperature_scale", logits.device.type)(ranked, temps)
    else:
        ranked = reported_logprobs(logits, temps)  # the default line's row: the ranking
    target = to_device(torch.tensor(targets, dtype=torch.long), logits.device)[:, None]
    ids = target
    if k:
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, : min(k, ranked.shape[1])]
        ids = torch.cat([target, order], dim=1)  # [n, 1 + k]
    if mode.endswith("logits"):
        values = ranked.gather(1, ids)
    else:
        line = params.logprob_formula or DEFAULT
        head = (rows, model.lm_head.weight)
        values = token_logprobs(logits, ids, [t] * n, [line] * n, head)
    ranks = (ranked > ranked.gather(1, target)).sum(-1) + 1
    ids_l, values_l, ranks_l = ids.tolist(), values.tolist(), ranks.tolist()
    return [
        PromptScore(i[0], v[0], r, list(zip(i[1:], v[1:], strict=True)))
        for i, v, r in zip(ids_l, values_l, ranks_l, strict=True)
    ]


def as_logprobs(scores: list[PromptScore], decode=None) -> PromptLogprobs:
    """vLLM's `RequestOutput.prompt_logprobs`: None for the first prompt token, then per
    position {token id: Logprob}, the prompt token first, then the top k. A prompt token among
    the top k is one entry (the same bits) with its place in the list as its rank, as vLLM's
    dict keeps it; so the entries ranked <= k are the top k, plus the prompt token when it is
    not one of them but ties the k-th. `decode(id)` -> text, or None."""
    out: PromptLogprobs = [None]
    text = decode if decode is not None else (lambda t: None)
    for s in scores:
        entry = {s.token: Logprob(s.value, s.rank, text(s.token))}
        for rank, (t, v) in enumerate(s.top, start=1):
            entry[t] = Logprob(v, rank, text(t))
        out.append(entry)
    return out


def token_text(tokenizer):
    """id -> its text for `Logprob.decoded_token`; None without a tokenizer."""
    return None if tokenizer is None else (lambda t: tokenizer.decode([t]))
