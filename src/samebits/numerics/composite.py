"""HF-order compositions: transformers' aten sequences, op for op (portable; every device).

These are the implementations the registry picks wherever no fused kernel is chosen. They
reduce through aten (`mean`), so inside `batch_invariant()` the reductions are the fixed
pairwise trees and outside it they are the stock kernels, exactly as transformers' modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from samebits.kernels.sample import race

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3MoeRMSNorm: fp32 variance and rsqrt, cast, then `weight *` in the weight's dtype."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`h = residual + x` rounded in the activation dtype, then `rms_norm(h)`; returns (h, norm)."""
    h = residual + x
    return h, rms_norm(h, weight, eps)


def _rotate_half(x: Tensor) -> Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """apply_rotary_pos_emb: `q*cos + rotate_half(q)*sin`, each op rounding on its own."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate_half(q) * sin)
    k_embed = (k * cos) + (_rotate_half(k) * sin)
    return q_embed, k_embed


def reported_logprobs(logits: Tensor, temps: Tensor, scale: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """The trainer's line `torch.log_softmax(logits.float() / T, dim=-1)`, each row at its own
    temperature: `scale(x, temps)` is the device's rounding of `x / T` (`ops.reported_logprobs`)."""
    return torch.log_softmax(scale(logits.float(), temps), dim=-1)


def sample_plain(
    logits: Tensor, temps: Tensor, keys: Tensor, random_row: Tensor, scale: Callable[[Tensor, Tensor], Tensor]
) -> tuple[Tensor, Tensor]:
    """The plain decode sample, op by op: the reported log-probs, then the race over their
    exp (`kernels.sample.race`) -> (tokens [N], log-probs [N])."""
    lps = reported_logprobs(logits, temps, scale)
    return race(lps, lps.exp(), logits.float(), keys, random_row)


def router(router_logits: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """transformers' MoE router after its linear, op by op: fp32 softmax, top-k, fp32 renorm,
    cast back (each op the active numerics' own)."""
    probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    top_value, top_index = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_value /= top_value.sum(dim=-1, keepdim=True)
    return top_value.to(router_logits.dtype), top_index
