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
time (`[ROWS, V]` float32 stays small beside the KV cache), and waits for them there, once a
sequence: a rare feature, not worth a second copy path. A step with no sequence left to score
(the runner's count, `ModelRunner.scoring`) costs nothing here. Only the first sample of a request scores (the n
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

ROWS = 64  # logits rows scored at once: a few float32 rows of the vocabulary each, ~200 MB at 151936


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


def score_batch(model, hidden: torch.Tensor, batch: ScheduledBatch) -> int:
    """Score the prompt positions this step computed (hidden [T, H], the chunks' rows in
    order): each asking sequence's `prompt_scores` grows by its new positions, in order, with
    one host copy a sequence. -> how many sequences scored their last position."""
    offset, done = 0, 0
    for c in batch.chunks:
        where = span(c)
        if where is not None:
            lo, hi = where
            seq = c.seq
            pieces = [
                score_rows(
                    model,
                    hidden[offset + a - c.start : offset + min(a + ROWS, hi) - c.start],
                    seq.token_ids[a + 1 : min(a + ROWS, hi) + 1],
                    seq.params,
                )
                for a in range(lo, hi, ROWS)
            ]
            ids, values, ranks = (torch.cat(t).tolist() for t in zip(*pieces, strict=True))
            seq.prompt_scores += [
                PromptScore(i[0], v[0], r, list(zip(i[1:], v[1:], strict=True)))
                for i, v, r in zip(ids, values, ranks, strict=True)
            ]
            seq.num_prompt_scored = hi
            done += hi == seq.num_prompt_tokens - 1
        offset += c.num_tokens
    return done


def score_rows(model, rows: torch.Tensor, targets: list[int], params: SamplingParams) -> tuple:
    """hidden rows [n, H] -> (ids [n, 1 + k]: each target token (targets[i] follows row i) then
    the row's top k; their values [n, 1 + k] float32; the targets' ranks [n]), on the device."""
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
    ids = torch.cat([target, top_ids(ranked, k)], dim=1) if k else target  # [n, 1 + k]
    if mode.endswith("logits"):
        values = ranked.gather(1, ids)
    else:
        line = params.logprob_formula or DEFAULT
        values = token_logprobs(logits, ids, [t] * n, [line] * n, (rows, model.lm_head.weight))
    ranks = (ranked > ranked.gather(1, target)).sum(-1) + 1
    return ids, values, ranks


MARGIN = 8  # candidates past k that `top_ids` takes, for ties at the k-th value


def top_ids(ranked: torch.Tensor, k: int) -> torch.Tensor:
    """The first k ids of each row of a stable descending sort of ranked [n, V] (ties: the
    lower id first; `sampler.Tops.of`'s order) -> [n, k]. From `topk` of k + MARGIN candidates,
    ordered by id and then stably by value, when every row has at most that many values at or
    above its k-th; else (many ties) the full sort."""
    k = min(k, ranked.shape[1])
    width = min(k + MARGIN, ranked.shape[1])
    values, ids = torch.topk(ranked, width, dim=-1)
    kth = values[:, k - 1 : k]
    if bool(((ranked >= kth).sum(-1) > width).any()):
        return torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :k]
    by_id = torch.sort(ids, dim=-1).values
    order = torch.sort(ranked.gather(1, by_id), dim=-1, descending=True, stable=True).indices
    return by_id.gather(1, order[:, :k])


def as_logprobs(scores: list[PromptScore]) -> PromptLogprobs:
    """vLLM's `RequestOutput.prompt_logprobs`: None for the first prompt token, then per
    position {token id: Logprob}, the prompt token first, then the top k. A prompt token among
    the top k is one entry (the same bits) with its place in the list as its rank, as vLLM's
    dict keeps it; so the entries ranked <= k are the top k, plus the prompt token when it is
    not one of them but ties the k-th. `decoded_token` is left None (the HTTP layer writes each
    token's text): decoding every entry of a long prompt would cost seconds."""
    out: PromptLogprobs = [None]
    for s in scores:
        entry = {s.token: Logprob(s.value, s.rank)}
        for rank, (t, v) in enumerate(s.top, start=1):
            entry[t] = Logprob(v, rank)
        out.append(entry)
    return out
