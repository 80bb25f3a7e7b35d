"""Sampling and the reported log-prob.

The reported log-prob is `log_softmax(logits.float() / T)` of the unmodified
distribution at the sampled token (T = 1 for greedy). What is sampled may be
narrowed by top-k, top-p and min_tokens; that changes the choice only.
Randomness is a pure function of (request seed, output index): a request gets
the same tokens alone, in any batch, and after preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from samebits.engine.sampling_params import SamplingParams
from samebits.numerics.ops import reported_logprobs

_MASK64 = (1 << 63) - 1


@dataclass(frozen=True)
class SampleRequest:
    """One row to sample: its settings, its seed, how many tokens it already has."""

    params: SamplingParams
    seed: int
    output_index: int
    banned: tuple[int, ...] = ()  # tokens not to sample yet (eos/stop before min_tokens)


def _generator(seed: int, output_index: int) -> torch.Generator:
    mixed = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    return torch.Generator(device="cpu").manual_seed(mixed)


def _narrow(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Zero the tokens outside top-k / top-p (probs [V] float32, on CPU)."""
    if params.top_k != -1 and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=0) - sorted_p  # mass of strictly better tokens
        keep_sorted = before < params.top_p * sorted_p.sum()
        keep = torch.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        probs = torch.where(keep, probs, 0.0)
    return probs


def sample_one(logprobs_row: torch.Tensor, logits_row: torch.Tensor, req: SampleRequest) -> int:
    """Choose one token for one row (logprobs_row is the reported distribution)."""
    if req.params.temperature == 0:
        scores = logits_row.float().cpu().clone()
        if req.banned:
            scores[list(req.banned)] = float("-inf")
        return int(torch.argmax(scores))
    probs = logprobs_row.cpu().exp()
    if req.banned:
        probs[list(req.banned)] = 0.0
    probs = _narrow(probs, req.params)
    if not bool((probs > 0).any()):  # everything allowed underflowed: take the best allowed logit
        scores = logits_row.float().cpu().clone()
        if req.banned:
            scores[list(req.banned)] = float("-inf")
        return int(torch.argmax(scores))
    noise = torch.empty_like(probs).exponential_(generator=_generator(req.seed, req.output_index))
    return int(torch.argmax(probs / noise))  # exponential race: P(i) = probs[i] / sum(probs)


def sample(logits: torch.Tensor, reqs: list[SampleRequest]) -> list[tuple[int, float]]:
    """logits [N, V] -> (token, float32 log-prob) per row."""
    lps = reported_logprobs(logits, [r.params.temperature for r in reqs])
    out = []
    for i, req in enumerate(reqs):
        token = sample_one(lps[i], logits[i], req)
        out.append((token, float(lps[i, token])))
    return out
