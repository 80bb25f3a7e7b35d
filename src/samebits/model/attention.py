"""The seam between engine and model: one attention batch, one attention op.

`AttentionBatch` describes every attention call there is: paged prefill, chunked
prefill, decode (the runner builds one per step, the CUDA graphs fill one from
static buffers) and the trainer's packed forward (its K/V are a cache with page
size 1). The model passes it to every attention layer untouched. Field names
follow vLLM's `FlashAttentionMetadata`. Shapes: T = tokens in the step,
B = sequences, P = pages of the longest sequence.

`samebits::paged_attention` is the one op that reads it: on the CPU the portable
`paged_attention_ref`, on CUDA the Triton kernel, both reading keys through the
block table, each with one numerics for every path. The choice is the tensors'
device: the op's dispatch, or for an eager call `_attention_kernel` (the same
kernel, called without custom_op's wrappers: `numerics/eager_op.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from samebits.kernels.attention import (
    packed_attention_backward_flash,
    packed_attention_backward_ref,
    paged_attention_ref,
)
from samebits.model.host_copy import to_device
from samebits.numerics.eager_op import EagerOp
from samebits.numerics.registry import _lazy

Tensor = torch.Tensor


@dataclass(frozen=True)
class AttentionBatch:
    """Which queries of a step attend over which keys, read through a block table.

    Build it with `build` (engine steps) or `packed` (the trainer); CUDA graphs fill one
    from static buffers. Key j of sequence b sits at cache slot
    `block_table[b, j // block_size] * block_size + j % block_size`.
    """

    positions: Tensor  # [T] long: position of each token in its sequence
    slot_mapping: Tensor  # [T] long: cache slot that receives each token's K/V
    block_table: Tensor  # [B, P] int32: cache block of each page, padded with 0
    query_start_loc: Tensor  # [B + 1] int32: row in T of each sequence's first query, then T
    query_lens: Tensor  # [B] int32: queries of each sequence this step
    seq_lens: Tensor  # [B] int32: keys of each sequence after this step (its queries included)
    max_query_len: int
    block_size: int  # tokens per page
    query_start_loc_cpu: Tensor | None = None  # [B + 1] host copy (None where built on the device)

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        starts: Sequence[int],
        num_tokens: Sequence[int],
        block_size: int,
        device,
    ) -> AttentionBatch:
        """One entry per sequence: its pages, the position of its first query this step (the
        tokens already in the cache) and its number of queries. Queries sit in T in entry
        order. Two host-to-device copies."""
        b = len(block_tables)
        if b == 0 or len(starts) != b or len(num_tokens) != b:
            raise ValueError(
                f"AttentionBatch.build: block_tables ({b}), starts ({len(starts)}) and num_tokens "
                f"({len(num_tokens)}) need one entry per sequence, at least one"
            )
        if block_size < 1:
            raise ValueError(f"AttentionBatch.build: block_size must be >= 1, got {block_size}")
        first = torch.tensor(starts, dtype=torch.long)
        lens = torch.tensor(num_tokens, dtype=torch.long)
        ends = first + lens
        for i, (table, end) in enumerate(zip(block_tables, ends.tolist(), strict=True)):
            if end > len(table) * block_size:
                raise ValueError(
                    f"AttentionBatch.build: sequence {i} has {end} keys but its block table holds "
                    f"{len(table)} pages of {block_size}"
                )
        qsl = torch.zeros(b + 1, dtype=torch.long)
        torch.cumsum(lens, 0, out=qsl[1:])
        seq = torch.repeat_interleave(torch.arange(b), lens)  # [T] sequence of each token
        positions = first[seq] + torch.arange(len(seq)) - qsl[seq]
        pages = max(len(t) for t in block_tables)
        table = torch.tensor([[*t, *[0] * (pages - len(t))] for t in block_tables], dtype=torch.long)
        slots = table[seq, positions // block_size] * block_size + positions % block_size
        t = len(seq)
        i64 = to_device(torch.cat([positions, slots]), device)
        i32 = to_device(torch.cat([table.flatten(), qsl, lens, ends]).to(torch.int32), device)
        tab, q_loc, q_lens, s_lens = i32.split([b * pages, b + 1, b, b])
        return cls(
            positions=i64[:t],
            slot_mapping=i64[t:],
            block_table=tab.view(b, pages),
            query_start_loc=q_loc,
            query_lens=q_lens,
            seq_lens=s_lens,
            max_query_len=int(lens.max()),
            block_size=block_size,
            query_start_loc_cpu=qsl.to(torch.int32),
        )

    @classmethod
    def packed(cls, seq_lens: Sequence[int], device) -> AttentionBatch:
        """Sequences of these lengths packed back to back in one row, their K/V the rows
        themselves (page size 1): the trainer's packed forward."""
        bounds, row = [], 0
        for n in seq_lens:
            bounds.append(list(range(row, row + n)))
            row += n
        return cls.build(bounds, [0] * len(bounds), list(seq_lens), 1, device)


@torch.library.custom_op("samebits::paged_attention", mutates_args=())
def _paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    query_start_loc: Tensor,
    query_lens: Tensor,
    seq_lens: Tensor,
    max_query_len: int,
    scale: float,
    block_size: int,
) -> Tensor:
    """Causal attention of every query over its own sequence's keys 0..p (see
    `paged_attention_ref`) -> [T, H, D]. The portable version; CUDA has the Triton kernel."""
    return paged_attention_ref(
        q,
        k_cache,
        v_cache,
        block_table,
        query_start_loc,
        query_lens,
        seq_lens,
        max_query_len,
        scale,
        block_size,
    )


# the Triton kernel, imported on its first call (the registry's lazy CUDA implementations)
_TRITON_ATTENTION = _lazy("samebits.kernels.attention_launch", "paged_attention")


def _attention_kernel(device: str):
    """The op's kernel on a device type: the Triton kernel on CUDA, the portable one elsewhere."""
    return _TRITON_ATTENTION if device == "cuda" else paged_attention_ref


@_paged_attention.register_kernel("cuda")
def _(*args):  # the op's arguments, in its order
    return _TRITON_ATTENTION(*args)


@_paged_attention.register_fake
def _(
    q, k_cache, v_cache, block_table, query_start_loc, query_lens, seq_lens, max_query_len, scale, block_size
):
    return torch.empty_like(q)


# eager calls run the kernel directly where that cannot differ from the op (numerics/eager_op.py)
_paged_attention = EagerOp(_paged_attention, _attention_kernel)


def _backward_cpu(grad_out, q, k, v, bounds, scale, cu_seqlens):
    return packed_attention_backward_ref(grad_out, q, k, v, bounds, scale)  # per sequence: host bounds


# The backward per device type. Not an op: each runs autograd (or flash's backward) inside, which
# an op's kernel cannot (it runs below the autograd dispatch). Gradients carry no bitwise contract.
_BACKWARD = {"cpu": _backward_cpu, "cuda": packed_attention_backward_flash}


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: AttentionBatch, scale: float) -> Tensor:
    """q [T, H, D] over k_cache/v_cache [slots, KVH, D] read through `batch` -> [T, H, D].
    The K/V of this step's tokens must already be in the cache."""
    return _paged_attention(
        q,
        k_cache,
        v_cache,
        batch.block_table,
        batch.query_start_loc,
        batch.query_lens,
        batch.seq_lens,
        batch.max_query_len,
        scale,
        batch.block_size,
    )


def paged_attention(
    q: Tensor,  # [T, H, D]
    k: Tensor,  # [T, KVH, D]
    v: Tensor,  # [T, KVH, D]
    k_cache: Tensor,  # [slots, KVH, D]
    v_cache: Tensor,  # [slots, KVH, D]
    meta: AttentionBatch,
    scale: float,
) -> Tensor:
    """Write this step's K/V into the cache, then attend each query over its sequence's keys."""
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    return attention(q, k_cache, v_cache, meta, scale)


class _PackedAttention(torch.autograd.Function):
    """Forward: the op. Backward: the device's `_BACKWARD` (CUDA: every sequence in two flash
    launches; CPU: per sequence, bounds on the host)."""

    @staticmethod
    def forward(ctx, q, k, v, batch, scale):
        ctx.save_for_backward(q, k, v, batch.query_start_loc)
        ctx.bounds, ctx.scale = batch.query_start_loc_cpu.tolist(), scale
        return attention(q, k, v, batch, scale)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, cu_seqlens = ctx.saved_tensors
        backward = _BACKWARD.get(q.device.type, _backward_cpu)
        dq, dk, dv = backward(grad_out, q, k, v, ctx.bounds, ctx.scale, cu_seqlens)
        return dq, dk, dv, None, None


def packed_attention(q: Tensor, k: Tensor, v: Tensor, batch: AttentionBatch, scale: float) -> Tensor:
    """`attention` over packed rows, differentiable: q [S, H, D], k/v [S, KVH, D] are the
    rows `AttentionBatch.packed` describes (they are their own cache) -> [S, H, D]."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        if batch.block_size != 1 or batch.query_start_loc_cpu is None:
            raise ValueError("packed_attention: a differentiable call needs a batch from AttentionBatch.packed")
        return _PackedAttention.apply(q, k, v, batch, scale)
    return attention(q, k, v, batch, scale)
