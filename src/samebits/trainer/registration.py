"""samebits' experts and attention, registered into transformers' interfaces.

After `register()` (done on `import samebits.trainer`), a transformers model
loaded with `experts_implementation="samebits"` and
`attn_implementation="samebits"` runs the same batch-invariant kernels as the
rollout engine.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary
from transformers import AttentionInterface
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.masking_utils import AttentionMaskInterface

from samebits.kernels.attention import segment_bounds
from samebits.model.attention import AttentionBatch, attention, packed_attention
from samebits.numerics.ops import experts

NAME = "samebits"


def samebits_experts(self, hidden_states, top_k_index, top_k_weights):
    """ExpertsInterface function: hidden [T, H], top_k_index/weights [T, K] -> [T, H]."""
    if getattr(self, "has_bias", False) or getattr(self, "is_transposed", False):
        raise NotImplementedError("samebits experts support untransposed, bias-free experts only")
    if not getattr(self, "has_gate", True) or not getattr(self, "is_concatenated", True):
        raise NotImplementedError("samebits experts need a concatenated [gate; up] gate_up_proj")
    if not _is_silu(self.act_fn):
        raise NotImplementedError(f"samebits experts support SiLU only, got {self.act_fn!r}")
    return experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def _is_silu(fn) -> bool:
    return fn is F.silu or isinstance(fn, torch.nn.SiLU) or type(fn).__name__ == "SiLUActivation"


def samebits_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function: q [B, H, S, D], k/v [B, KVH, Sk, D] -> ([B, S, H, D], None).

    Packed sequences are found from `position_ids` restarting (use_cache=False);
    with a KV cache (Sk > S) the queries are the last S positions. Each row of the
    batch runs the engine's op over an `AttentionBatch` with page size 1.
    """
    if dropout:
        raise ValueError("samebits attention has no dropout; set attention_dropout=0")
    if attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.all():
        attention_mask = None
    if attention_mask is not None:
        raise ValueError(
            "samebits attention takes no padding mask: pass unpadded sequences, packed with "
            "position_ids restarting at 0 for each one"
        )
    scale = module.head_dim**-0.5 if scaling is None else scaling
    q = query.transpose(1, 2)  # [B, S, H, D]
    k = key.transpose(1, 2)  # [B, Sk, KVH, D]
    v = value.transpose(1, 2)
    b, s = q.shape[:2]
    sk = k.shape[1]
    if sk != s:  # queries are the last s positions over a cache of sk keys: inference only
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError(
                "samebits attention trains on packed rows only: call the model with use_cache=False"
            )
        batch = AttentionBatch.build([range(sk)], [sk - s], [s], 1, q.device)
        return _rows([attention(q[i], k[i], v[i], batch, scale) for i in range(b)]), None
    batches = _row_batches(kwargs.get("position_ids"), b, s, q.device)
    return _rows([packed_attention(q[i], k[i], v[i], batches[i], scale) for i in range(b)]), None


def _rows(outs: list[torch.Tensor]) -> torch.Tensor:
    """Per-row outputs [S, H, D] -> [B, S, H, D]; one row (a packed micro-batch) as a view, not a copy."""
    return outs[0].unsqueeze(0) if len(outs) == 1 else torch.stack(outs)


def _row_batches(position_ids, b: int, s: int, device) -> list[AttentionBatch]:
    """One packed `AttentionBatch` per row of a [B, S] forward (one sequence per row without
    position_ids)."""
    if position_ids is None:
        return [_whole_row(s, device)] * b
    batches = _packings(position_ids)
    if len(batches) not in (1, b):
        raise ValueError(f"position_ids {tuple(position_ids.shape)} do not match a batch of {b} rows")
    return batches * b if len(batches) == 1 else batches


@functools.lru_cache(maxsize=64)
def _whole_row(s: int, device) -> AttentionBatch:
    return AttentionBatch.packed([s], device)


# position_ids tensor -> (its version, one AttentionBatch per row). transformers hands every layer
# the same position_ids object, so a packed forward reads the positions to the host (a device
# sync) once instead of once per layer; the version check notices an in-place change.
_PACKINGS = WeakTensorKeyDictionary()


def _packings(position_ids: torch.Tensor) -> list[AttentionBatch]:
    hit = _PACKINGS.get(position_ids)
    if hit is not None and hit[0] == position_ids._version:
        return hit[1]
    return remember_packings(position_ids, position_ids)


def remember_packings(position_ids: torch.Tensor, host_positions: torch.Tensor) -> list[AttentionBatch]:
    """Read the packing of `position_ids` from `host_positions`, a host copy of the same values,
    and keep it for the forward that passes `position_ids`: a caller that built the positions
    on the host saves the forward its one read of them from the device (a sync)."""
    rows = host_positions.view(-1, host_positions.shape[-1])
    batches = [
        AttentionBatch.packed([e - s for s, e in segment_bounds(row)], position_ids.device) for row in rows
    ]
    _PACKINGS[position_ids] = (position_ids._version, batches)
    return batches


def samebits_mask(*args, attention_mask=None, **kwargs):
    """AttentionMaskInterface function: causality and packing come from positions, so the
    only thing to do with a padding mask is to refuse it (it would be ignored otherwise)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "samebits attention takes no padding mask: pass unpadded sequences (one per row, or "
            "packed into one row with position_ids restarting at 0 for each sequence)"
        )
    return None


def register() -> None:
    """Register `samebits` as an experts, attention and mask implementation (idempotent)."""
    ALL_EXPERTS_FUNCTIONS.register(NAME, samebits_experts)
    AttentionInterface.register(NAME, samebits_attention)
    AttentionMaskInterface.register(NAME, samebits_mask)
