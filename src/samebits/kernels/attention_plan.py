"""Which path a call of the Triton attention kernel takes (pure Python: no Triton, no device).

`attention_launch.attention` runs one of four paths, all with the same bits for a row:
tiles of BLOCK_M (token, head) rows or transposed tiles of BLOCK_Q rows (keys on the MMA's
M), and a row's 256-key chunks in one program or split over parallel programs merged by the
last of them to finish (transposed tiles) or by a second launch (64-row tiles). `plan` picks
one from the call's shape; the launcher and the benchmark both ask it, and the CPU tests
check it.

Transposed tiles give the 64-row tiles' bits because every product element, the row sums of
p included, is one tensor-core dot product wherever it sits in the tile. That was compared on
an H200 at 32 query / 4 kv heads of 128 in bf16 (`tests/test_gpu_kernels.py`, the 48-layer
probe), so the default takes them only at that head layout: 8 query heads per kv head, head
dim 128, bf16. Other shapes run the 64-row tiles until their bits are compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_M = 64  # (token, head) rows of a tile
BLOCK_Q = 16  # rows of a transposed tile (the MMA's N): two tokens of 8 query heads
TRANSPOSED_SHAPE = {"group": 8, "head_dim": 128, "dtype": torch.bfloat16}  # where the bits were compared
_COMPARED = tuple(TRANSPOSED_SHAPE.values())


# (num_warps, num_stages) of a launch. Neither changed a row's bits at the compared layout on
# the H200 (with 2 warps Triton likely issues mma.sync rather than wgmma: an empirical fact,
# which `test_gpu_kernels.py` guards by comparing the transposed decode tiles at each launch
# against the trainer's 64-row tiles). H200, 1024 keys, CUDA graph, us
# (docs/performance.md, 2026-12-04): transposed one-program decode at 64 sequences
# (4, 2) 50.3, (4, 3) 52.4, (2, 2) 56.3; at 256 sequences (2, 2) 139.9, (4, 2) 160.0, (4, 3)
# 163.2 against a 125 us floor: two warps let more programs share an SM once there are several
# a SM to hide each other's loads. Below that the launch stays (4, 3): (4, 2) was faster alone
# but the one end-to-end run with it gave batch 64 19.35 ms a token against 19.11 with (4, 3),
# within a lease's spread and not yet separated.
LAUNCH = (4, 3)  # 64-row tiles (prefill, the trainer) and split decode in 64-row tiles
DECODE_LAUNCH = (4, 3)  # transposed, one program per sequence and kv head
# Split decode in transposed tiles, merged in the last program: H200, 1024 keys, CUDA graph
# (attention_configs.py --launches, 2026-12-04), (4, 2) 10.3 / 10.6 / 14.6 us against
# (4, 3) 12.7 / 12.9 / 16.9 at 1 / 4 / 16 sequences, the same bits.
SPLIT_DECODE_LAUNCH = (4, 2)
DECODE_LAUNCH_MANY = (2, 2)  # the same from MANY_PROGRAMS_PER_SM programs a SM
MANY_PROGRAMS_PER_SM = 4


# A split call's chunks merged by the last chunk program of each (sequence, kv head) to finish
# (a ticket counter) rather than by `attention_triton.combine_kernel` in a second launch: the same operations in
# the same order. H200, 1024 keys, CUDA graph (docs/performance.md, 2026-12-04), in
# transposed tiles: 13.0 us against 16.4 at one sequence, 16.1 against 19.9 at 16, 34.5 against
# 37.5 at 32; batch-1 decode 4.40 ms a token against 4.61, the 48-layer probe 0 mismatches. In
# 64-row tiles (head layouts other than the compared one) the last program's merge of 64-row
# partials lost (19.5 against 17.9 us at one sequence, 49.6 against 41.5 at 32): there the
# default keeps the combine launch.
MERGE_LAST = True


@dataclass(frozen=True)
class Plan:
    transposed: bool
    split: bool
    rows: int  # (token, head) rows of a tile
    tokens_per_tile: int
    warps: int = LAUNCH[0]
    stages: int = LAUNCH[1]
    merge_last: bool = False  # a split call's chunks merged by its last program (MERGE_LAST)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def transposed_fits(max_q_len: int, group: int, head_dim: int, dtype: torch.dtype) -> str | None:
    """None when transposed tiles can take the call, else why not."""
    if max_q_len * _pow2(group) > BLOCK_Q:
        return f"{max_q_len} queries x {_pow2(group)} padded heads per kv head exceed {BLOCK_Q} rows"
    want = TRANSPOSED_SHAPE
    if (group, head_dim, dtype) != _COMPARED:
        return (
            f"transposed tiles run only where their bits were compared with the 64-row tiles: "
            f"{want['group']} query heads per kv head, head_dim {want['head_dim']}, {want['dtype']} "
            f"(got {group}, {head_dim}, {dtype})"
        )
    return None


def plan(
    max_q_len: int,
    batch: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    sms: int,
    split: bool | None = None,
    transposed: bool | None = None,
) -> Plan:
    """The path of a call with `batch` sequences of at most `max_q_len` queries each.

    transposed (None): when `transposed_fits`. split (None): when every sequence's queries fit
    one tile and the call has fewer programs (sequences x kv heads) than `sms`. Measured on the
    H200 in a CUDA graph at 4 kv heads and 1024 keys (docs/performance.md, 2026-12-04): the
    split wins up to 32 sequences in either orientation (transposed 37.1 vs 44.3 us, 64 rows
    41.0 vs 47.6) and loses from 64 (56.8 vs 52.1, 70.2 vs 55.8). The launch (warps, stages):
    `LAUNCH`, or for transposed tiles `SPLIT_DECODE_LAUNCH` split and in one program
    `DECODE_LAUNCH` / `DECODE_LAUNCH_MANY`;
    a split call in transposed tiles merges in its last program (`MERGE_LAST`; above). A forced
    choice the call cannot take raises ValueError."""
    fits = max_q_len * _pow2(group) <= BLOCK_Q and _COMPARED == (group, head_dim, dtype)  # no strings: hot path
    if transposed is None:
        transposed = fits
    elif transposed and not fits:
        why = transposed_fits(max_q_len, group, head_dim, dtype)
        raise ValueError(f"attention: transposed tiles cannot take this call: {why}")
    rows = BLOCK_Q if transposed else BLOCK_M
    tokens = rows // _pow2(group)
    one_tile = max_q_len <= tokens
    if split is None:
        split = one_tile and batch * kv_heads < sms
    elif split and not one_tile:
        raise ValueError(f"attention: split needs at most {tokens} queries per sequence, got {max_q_len}")
    launch = LAUNCH
    if transposed and split:
        launch = SPLIT_DECODE_LAUNCH
    elif transposed:
        launch = DECODE_LAUNCH_MANY if batch * kv_heads >= MANY_PROGRAMS_PER_SM * sms else DECODE_LAUNCH
    return Plan(transposed, split, rows, tokens, *launch, merge_last=split and transposed and MERGE_LAST)
