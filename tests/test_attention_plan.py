"""The Triton attention's path choice (`kernels.attention_plan.plan`): pure Python, no device."""

from __future__ import annotations

import pytest
import torch

from samebits.kernels.attention_plan import (
    BLOCK_M,
    BLOCK_Q,
    DECODE_LAUNCH,
    DECODE_LAUNCH_MANY,
    LAUNCH,
    SPLIT_DECODE_LAUNCH,
    plan,
)

BF16 = torch.bfloat16
H200_SMS = 132


def _plan(max_q_len, batch, group=8, head_dim=128, dtype=BF16, kv_heads=4, **kw):
    return plan(max_q_len, batch, kv_heads, group, head_dim, dtype, H200_SMS, **kw)


@pytest.mark.parametrize(
    "max_q_len,batch,transposed,split",
    [
        (1, 1, True, True),  # small decode batch: transposed tiles, keys split
        (1, 32, True, True),  # 128 programs < 132 SMs
        (1, 33, True, False),  # 132 programs: one program per tile
        (1, 256, True, False),
        (2, 8, True, True),  # two queries x 8 heads fill one 16-row tile
        (3, 8, False, True),  # 24 rows: 64-row tiles (8 tokens each), still one tile
        (9, 8, False, False),  # two 64-row tiles
        (1024, 8, False, False),  # prefill
    ],
)
def test_the_measured_head_layout_takes_the_measured_paths(max_q_len, batch, transposed, split):
    p = _plan(max_q_len, batch)
    assert (p.transposed, p.split) == (transposed, split)
    assert p.rows == (BLOCK_Q if transposed else BLOCK_M) and p.tokens_per_tile == p.rows // 8


@pytest.mark.parametrize(
    "shape", [dict(group=16), dict(group=4), dict(head_dim=96), dict(head_dim=64), dict(dtype=torch.float16)]
)
def test_shapes_whose_bits_were_not_compared_keep_64_row_tiles(shape):
    """Transposed tiles give the 64-row tiles' bits only where that was compared (8 query heads
    per kv head, head_dim 128, bf16); elsewhere the default keeps the 64-row tiles and a forced
    transposed call says why it cannot run."""
    assert not _plan(1, 4, **shape).transposed
    with pytest.raises(ValueError, match="bits were compared"):
        _plan(1, 4, transposed=True, **shape)


def test_forced_paths_the_call_cannot_take_are_refused():
    with pytest.raises(ValueError, match="3 queries x 8 padded heads"):
        _plan(3, 4, transposed=True)
    with pytest.raises(ValueError, match="split needs at most 8 queries"):
        _plan(9, 4, split=True)
    forced = _plan(1, 256, split=True, transposed=False)  # a forced path the call can take is taken
    assert (forced.split, forced.transposed, forced.rows) == (True, False, BLOCK_M)


@pytest.mark.parametrize(
    "max_q_len,batch,launch",
    [
        (1, 1, SPLIT_DECODE_LAUNCH),  # split decode in transposed tiles
        (1, 32, SPLIT_DECODE_LAUNCH),  # 128 programs: still split
        (1, 33, DECODE_LAUNCH),  # transposed, one program: 132 programs, one a SM
        (1, 131, DECODE_LAUNCH),  # 524 programs: under 4 a SM
        (1, 132, DECODE_LAUNCH_MANY),  # 528: 4 a SM, two warps each
        (1, 256, DECODE_LAUNCH_MANY),
        (9, 256, LAUNCH),  # 64-row tiles
        (1024, 8, LAUNCH),  # prefill, the trainer
    ],
)
def test_the_launch_follows_the_path_and_the_programs_a_sm(max_q_len, batch, launch):
    """(warps, stages): two warps for transposed one-program decode from 4 programs a SM, four
    below it; split decode in transposed tiles `SPLIT_DECODE_LAUNCH`; prefill and the trainer
    keep `LAUNCH`. (Their bits are the same at
    every launch at the compared layout: the GPU tests compare each.)"""
    p = _plan(max_q_len, batch)
    assert (p.warps, p.stages) == launch


@pytest.mark.parametrize(
    "max_q_len,batch,transposed,merge_last",
    [
        (1, 1, None, True),  # split in transposed tiles: the last program merges
        (1, 32, None, True),
        (1, 33, None, False),  # one program: nothing to merge
        (3, 8, None, False),  # split in 64-row tiles: the merging launch
        (1, 4, False, False),  # forced 64-row tiles
    ],
)
def test_split_calls_merge_in_their_last_program_only_in_transposed_tiles(
    max_q_len, batch, transposed, merge_last
):
    assert _plan(max_q_len, batch, transposed=transposed).merge_last is merge_last
