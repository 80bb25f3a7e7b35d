"""The exponential race over a log-softmax row, in portable torch (every device; the oracle
of the fused CUDA kernel, `sample_triton`).

Randomness is a pure function of (two 32-bit row keys, token id): a counter-based hash
(`fmix32`, a 32-bit integer mixer) turned into Exp(1) noise, so a row gets the same noise
alone, in any batch and after preemption, with no generator state. The race picks
argmax(p_i / noise_i), which samples token i with probability p_i / sum(p).
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
MIX1, MIX2 = 0x7FEB352D, 0x5BD1E995  # fmix32's multipliers (< 2**31)


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 lanes holding uint32 values; multipliers < 2**31 keep
    products < 2**63, and `& M32` is the uint32 wrap-around."""
    x = x ^ (x >> 16)
    x = (x * MIX1) & M32
    x = x ^ (x >> 15)
    x = (x * MIX2) & M32
    return x ^ (x >> 16)


UNIFORM_BITS = 23  # u's random bits: k + 0.5 (k < 2**23) is exact in float32, so u < 1


def uniform(h: torch.Tensor) -> torch.Tensor:
    """Hashes h (uint32 values, any int dtype) -> u = ((h >> 9) + 0.5) / 2**23 in float32,
    every value exact and strictly inside (0, 1). (With 24 bits, k + 0.5 for k = 2**24 - 1
    rounds to 2**24: u = 1, noise -0.0, and a token of probability 0 raced 0 / -0.0 = NaN,
    which argmax picks.)"""
    return ((h >> (32 - UNIFORM_BITS)).to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [N, 2] int64 (uint32 values) -> Exp(1) noise [N, V] float32, a pure function of
    (keys, token id): `-log(u)` (> 0) with u = `uniform(hash)`."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)[None, :]
    x = fmix32(fmix32(ids ^ keys[:, :1]) ^ keys[:, 1:])
    return -torch.log(uniform(x))


def race(
    lps: torch.Tensor, probs: torch.Tensor, scores: torch.Tensor, keys: torch.Tensor, random_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device ops only: the exponential race per row (P(i) = p_i / sum p), the best logit for
    greedy rows and rows whose allowed probabilities all underflowed -> (tokens [N], log-probs [N]).
    Ties go to the lower token id (torch.argmax's rule)."""
    raced = torch.argmax(probs / exponential_noise(keys, probs.shape[1]), dim=-1)
    usable = (probs > 0).any(dim=-1) & random_row
    tokens = torch.where(usable, raced, torch.argmax(scores, dim=-1))
    return tokens, lps.gather(1, tokens[:, None])[:, 0]
