"""The seam between engine and model: what attention needs to know about a batch.

The runner builds one `PagedAttentionMetadata` per step; the model passes it to
every attention layer untouched. Shapes: T = tokens in the step, B = sequences,
R = the longest query chunk, L = the longest context (keys after this step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from samebits.kernels.attention import attention_ref


@dataclass(frozen=True)
class PagedAttentionMetadata:
    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot that receives each token's K/V
    key_slots: torch.Tensor  # [B, L] cache slots of each sequence's keys, padded
    query_rows: torch.Tensor  # [B, R] row in T of each query, padded with 0
    query_pos: torch.Tensor  # [B, R] position of each query, padded with 0
    token_index: torch.Tensor  # [T] index of each token in the flattened [B * R]


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [slots, KVH, D]
    v_cache: torch.Tensor,  # [slots, KVH, D]
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend each query over its sequence's keys."""
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    keys = k_cache[meta.key_slots]  # [B, L, KVH, D]
    values = v_cache[meta.key_slots]
    queries = q[meta.query_rows]  # [B, R, H, D]
    out = attention_ref(queries, keys, values, meta.query_pos, scale)
    return out.flatten(0, 1)[meta.token_index]  # [T, H, D]
