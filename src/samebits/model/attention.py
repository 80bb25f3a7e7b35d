"""The seam between engine and model: what attention needs to know about a batch.

The runner builds one `PagedAttentionMetadata` per step; the model passes it to
every attention layer untouched. Shapes: T = tokens in the step, B = sequences,
R = the longest query chunk, L = the longest context (keys after this step),
P = pages of the longest sequence.

Two kernels read it, one per device, each with one numerics for every path:
on the CPU the portable `attention_ref` (fields `key_slots`, `query_rows`,
`query_pos`, `token_index`); on CUDA the Triton kernel (fields `block_tables`,
`q_start`, `q_len`, `ctx_len`, `max_q_len`). The runner fills the set its
device uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from samebits.kernels.attention import attention_ref


@dataclass(frozen=True)
class PagedAttentionMetadata:
    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot that receives each token's K/V
    # portable path (CPU)
    key_slots: torch.Tensor | None = None  # [B, L] cache slots of each sequence's keys, padded
    query_rows: torch.Tensor | None = None  # [B, R] row in T of each query, padded with 0
    query_pos: torch.Tensor | None = None  # [B, R] position of each query, padded with 0
    token_index: torch.Tensor | None = None  # [T] index of each token in the flattened [B * R]
    # Triton path (CUDA)
    block_tables: torch.Tensor | None = None  # [B, P] int32 cache block of each page
    q_start: torch.Tensor | None = None  # [B] int32 row in T of each sequence's first query
    q_len: torch.Tensor | None = None  # [B] int32 queries of each sequence this step
    ctx_len: torch.Tensor | None = None  # [B] int32 keys of each sequence after this step
    max_q_len: int = 0
    block_size: int = 0


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
    if meta.block_tables is not None:
        from samebits.kernels.attention_triton import attention

        return attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.q_start,
            meta.q_len,
            meta.ctx_len,
            meta.max_q_len,
            scale,
            meta.block_size,
        )
    keys = k_cache[meta.key_slots]  # [B, L, KVH, D]
    values = v_cache[meta.key_slots]
    queries = q[meta.query_rows]  # [B, R, H, D]
    out = attention_ref(queries, keys, values, meta.query_pos, scale)
    return out.flatten(0, 1)[meta.token_index]  # [T, H, D]
