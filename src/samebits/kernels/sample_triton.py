"""The plain decode sample in five launches, with the bits of the op-by-op path.

`composite.sample_plain` on CUDA inside `batch_invariant()` runs about 43 kernels over
[N, V] tensors, most of them int64 for the noise (about 530 bytes per (row, token),
docs/performance.md). This does the same arithmetic reading the bf16 logits three times:

1. `_max_kernel`: per program, the max logit and its first index (greedy, and the
   log-softmax shift: `max(x * r) == max(x) * r` for r > 0, rounding is monotone).
2. `_sum_kernel`: exp(x * r - m), summed per lane in `tree_sum_ref`'s order (below).
3. `_total_kernel`: log of the row's sum, the tree of its lane sums.
4. `_race_kernel` (contiguous blocks of RACE_BLOCK ids): per element the log-prob
   `(x * r - m) - log(total)`, p = exp(log-prob),
   the noise and the race `p / noise`.
5. `_finish_kernel`: per row, the race's or the greedy winner and its log-prob.

The same roundings in the same order as the torch path:
- `r` is the IEEE float32 reciprocal of T (`div_rn`), as `torch.reciprocal`; the scaled
  logit `x * r` is rounded before the shift (no FMA contraction: every launch passes
  `enable_fp_fusion=False`).
- exp and log are libdevice's `expf`/`logf`, the functions torch's CUDA kernels call
  (`tl.exp`/`tl.log` may lower to the approximate `ex2`/`lg2` instructions); the race's
  division is `div_rn` (IEEE), as torch's `/`. Triton compiles libdevice with flush to zero,
  so an exp that torch rounds to a subnormal (arguments below about -87.3) is 0 here: such
  a p can never win the race (the best token has p >= 1/V), and such a term of the sum
  cannot move a total >= 1; the tests compare every bit of the results.
- The noise is `fmix32` in uint32 lanes: integer ops, so the same bits as the int64 lanes.
- The sum: `tree_sum_ref` over a row of V is the halving tree of the row padded to W (the
  next power of two): fold element i onto i + W/2, then W/4, ... Split W = S * C with
  S = 64: after log2(S) folds, lane i < C holds the halving tree of the S elements i + c*C
  (c < S, folded c onto c + S/2 first), and the last log2(C) folds are the halving tree of
  the C lanes. `_sum_kernel` computes each lane's tree with elementwise adds of [L]-lane
  vectors (c = a + 8b: a tree over b per a, then over a), `_total_kernel` the lanes' tree
  (`tree_sum_block`). Pads are +0.0 where `tree_sum_ref` pads with -0.0: every term is an
  exp, never -0.0, so a +0.0 pad adds nothing either.
Argmaxes keep the lowest index among equal values (torch.argmax's documented rule) and take
a NaN as the largest value, as torch.argmax and amax do: a row with a NaN logit gets NaN
log-probs and its first NaN token, as the op-by-op path gives it.

`log_softmax` runs launches 1-3 at T = 1 and writes every id's log-prob: batch_invariant()'s
`_log_softmax` over a vocabulary on CUDA (the trainer's line), with the composite's bits.

The launchers (`sample`, `race`, `log_softmax`) are in `sample_launch.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from samebits.kernels.launch import fast_launch
from samebits.kernels.reduce_triton import _INTERPRET, tree_sum_block
from samebits.kernels.sample import MIX1, MIX2, UNIFORM_BITS

_MIX1, _MIX2 = tl.constexpr(MIX1), tl.constexpr(MIX2)
_UNIFORM_SHIFT, _UNIFORM_SCALE = tl.constexpr(32 - UNIFORM_BITS), tl.constexpr(1.0 / (1 << UNIFORM_BITS))

LANES = 128  # L: lanes per program (a program's tile is [S, L], S * L <= 8192 elements)
STRIDED = 64  # S: strided elements per lane
RACE_BLOCK = 8192  # contiguous token ids per program of the race
_BIG = tl.constexpr(2**31 - 1)  # "no index" for the argmaxes' min-index tie rule


if _INTERPRET:  # Triton's CPU interpreter has no libdevice: numpy's exp/log (development only)

    @triton.jit
    def _expf(x):
        return tl.exp(x)

    @triton.jit
    def _logf(x):
        return tl.log(x)

else:

    @triton.jit
    def _expf(x):
        return libdevice.exp(x)

    @triton.jit
    def _logf(x):
        return libdevice.log(x)


@triton.jit
def _tile(logits_ptr, row, stride, vocab, p, S: tl.constexpr, L: tl.constexpr, C: tl.constexpr):
    """Token ids [S, L] of program p's tile (lane p*L + j, strided element c: id c*C + p*L + j)
    and their logits in float32 (masked ids: -inf)."""
    ids = tl.arange(0, S)[:, None] * C + p * L + tl.arange(0, L)[None, :]
    mask = ids < vocab
    x = tl.load(logits_ptr + row * stride + ids, mask=mask, other=float("-inf")).to(tl.float32)
    return ids, mask, x


@triton.jit
def _first_max(v, ids):
    """The max of v [n] and the lowest id holding it, NaN the largest value (torch.argmax's
    and amax's rule; `tl.max` alone would pass over a NaN)."""
    nan_id = tl.min(tl.where(v != v, ids, _BIG), axis=0)
    best = tl.max(v, axis=0)
    first = tl.min(tl.where(v == best, ids, _BIG), axis=0)
    has_nan = nan_id < _BIG
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, nan_id, first)


@triton.jit
def _first_max_2d(v, ids):
    """`_first_max` of v [S, L]."""
    nan_id = tl.min(tl.min(tl.where(v != v, ids, _BIG), axis=1), axis=0)
    best = tl.max(tl.max(v, axis=1), axis=0)
    first = tl.min(tl.min(tl.where(v == best, ids, _BIG), axis=1), axis=0)
    has_nan = nan_id < _BIG
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, nan_id, first)


@triton.jit
def _row_shift(part_val_ptr, row, temps_ptr, P: tl.constexpr):
    """-> (r, m): the row's IEEE 1/T and the log-softmax shift max(x) * r, from the max partials."""
    r = tl.div_rn(1.0, tl.load(temps_ptr + row))
    m = tl.max(tl.load(part_val_ptr + row * P + tl.arange(0, P)), axis=0) * r
    return r, m


@fast_launch
@triton.jit
def _max_kernel(
    logits_ptr, stride, vocab, max_val_ptr, max_idx_ptr,
    S: tl.constexpr, L: tl.constexpr, C: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    row, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    ids, mask, x = _tile(logits_ptr, row, stride, vocab, p, S, L, C)
    best, first = _first_max_2d(x, ids)
    tl.store(max_val_ptr + row * P + p, best)
    tl.store(max_idx_ptr + row * P + p, first)


@triton.jit
def _t8(v0, v1, v2, v3, v4, v5, v6, v7):
    """The halving tree of 8 values: fold i onto i + 4, then + 2, then + 1."""
    return ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))


@triton.jit
def _exp_row(logits_ptr, row, stride, vocab, ids, r, m):
    """exp(x * r - m) at token ids [L] (0 past the vocabulary)."""
    mask = ids < vocab
    x = tl.load(logits_ptr + row * stride + ids, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.where(mask, _expf(x * r - m), 0.0)


@triton.jit
def _exp_t8(logits_ptr, row, stride, vocab, lanes, a, r, m, C: tl.constexpr):
    """The halving tree over b < 8 of exp(...) at ids (a + 8b) * C + lanes: strided elements
    a + 8b of each lane, folded on b's top bit first."""
    return _t8(
        _exp_row(logits_ptr, row, stride, vocab, (a + 0) * C + lanes, r, m),
        _exp_row(logits_ptr, row, stride, vocab, (a + 8) * C + lanes, r, m),
        _exp_row(logits_ptr, row, stride, vocab, (a + 16) * C + lanes, r, m),
        _exp_row(logits_ptr, row, stride, vocab, (a + 24) * C + lanes, r, m),
        _exp_row(logits_ptr, row, stride, vocab, (a + 32) * C + lanes, r, m),
        _exp_row(logits_ptr, row, stride, vocab, (a + 40) * C + lanes, r, m),
        _exp_row(logits_ptr, row, stride, vocab, (a + 48) * C + lanes, r, m),
        _exp_row(logits_ptr, row, stride, vocab, (a + 56) * C + lanes, r, m),
    )


@fast_launch
@triton.jit
def _sum_kernel(
    logits_ptr, stride, vocab, temps_ptr, max_val_ptr, lanes_ptr,
    S: tl.constexpr, L: tl.constexpr, C: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    """Lane sums: for each of the program's L lanes, the halving tree of its S = 64 strided
    elements c = a + 8b: an inner tree over b (bits 5..3 of c, folded first) per a, then the
    tree over a (bits 2..0). Elementwise adds of [L] vectors, in registers."""
    row, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r, m = _row_shift(max_val_ptr, row, temps_ptr, P)
    lanes = p * L + tl.arange(0, L)
    total = _t8(
        _exp_t8(logits_ptr, row, stride, vocab, lanes, 0, r, m, C),
        _exp_t8(logits_ptr, row, stride, vocab, lanes, 1, r, m, C),
        _exp_t8(logits_ptr, row, stride, vocab, lanes, 2, r, m, C),
        _exp_t8(logits_ptr, row, stride, vocab, lanes, 3, r, m, C),
        _exp_t8(logits_ptr, row, stride, vocab, lanes, 4, r, m, C),
        _exp_t8(logits_ptr, row, stride, vocab, lanes, 5, r, m, C),
        _exp_t8(logits_ptr, row, stride, vocab, lanes, 6, r, m, C),
        _exp_t8(logits_ptr, row, stride, vocab, lanes, 7, r, m, C),
    )
    tl.store(lanes_ptr + row * C + lanes, total)


@fast_launch
@triton.jit
def _total_kernel(lanes_ptr, log_total_ptr, C: tl.constexpr):
    """log of the row's sum: the halving tree of its C lane sums (the last log2(C) folds)."""
    row = tl.program_id(0).to(tl.int64)
    tl.store(log_total_ptr + row, _logf(tree_sum_block(tl.load(lanes_ptr + row * C + tl.arange(0, C)), C)))


@triton.jit
def _fmix32(x):
    x = x ^ (x >> 16)
    x = x * _MIX1
    x = x ^ (x >> 15)
    x = x * _MIX2
    return x ^ (x >> 16)


@fast_launch
@triton.jit
def _race_kernel(
    logits_ptr, stride, vocab, temps_ptr, keys_ptr, max_val_ptr,
    race_val_ptr, race_idx_ptr, any_ptr, shift_ptr, log_total_ptr,
    P: tl.constexpr, PR: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program p of a row races token ids [p * BLOCK, (p + 1) * BLOCK): contiguous, since an
    argmax (with its lowest-id rule) does not depend on how the ids are split, so no program
    computes the padding up to the next power of two that the sum's tree layout has."""
    row, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r, m = _row_shift(max_val_ptr, row, temps_ptr, P)
    log_total = tl.load(log_total_ptr + row)
    if p == 0:
        tl.store(shift_ptr + row, m)
    ids = p * BLOCK + tl.arange(0, BLOCK)
    mask = ids < vocab
    x = tl.load(logits_ptr + row * stride + ids, mask=mask, other=float("-inf")).to(tl.float32)
    probs = _expf((x * r - m) - log_total)
    _race_block(probs, ids, mask, row, p, keys_ptr, race_val_ptr, race_idx_ptr, any_ptr, PR)


@triton.jit
def _race_block(probs, ids, mask, row, p, keys_ptr, race_val_ptr, race_idx_ptr, any_ptr, PR: tl.constexpr):
    """The race over one block of a row's ids: the noise (`kernels.sample.exponential_noise`),
    the best `p / noise` and its lowest id (NaN the largest), and whether some p > 0: stored as
    program p's partials of the row."""
    key0 = tl.load(keys_ptr + row * 2).to(tl.uint32)
    key1 = tl.load(keys_ptr + row * 2 + 1).to(tl.uint32)
    h = _fmix32(_fmix32(ids.to(tl.uint32) ^ key0) ^ key1)
    u = ((h >> _UNIFORM_SHIFT).to(tl.float32) + 0.5) * _UNIFORM_SCALE  # `kernels.sample.uniform`
    ratio = tl.where(mask, tl.div_rn(probs, -_logf(u)), -1.0)  # ratios >= 0: pads never win
    best, first = _first_max(ratio, ids)
    positive = tl.max(tl.where(mask & (probs > 0), 1, 0), axis=0)
    tl.store(race_val_ptr + row * PR + p, best)
    tl.store(race_idx_ptr + row * PR + p, first)
    tl.store(any_ptr + row * PR + p, positive)


@fast_launch
@triton.jit
def _race_probs_kernel(
    probs_ptr,
    stride,
    vocab,
    keys_ptr,
    race_val_ptr,
    race_idx_ptr,
    any_ptr,
    PR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """`_race_kernel` over probabilities given in float32 (the sampler's narrowed rows)."""
    row, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    ids = p * BLOCK + tl.arange(0, BLOCK)
    mask = ids < vocab
    probs = tl.load(probs_ptr + row * stride + ids, mask=mask, other=0.0)
    _race_block(probs, ids, mask, row, p, keys_ptr, race_val_ptr, race_idx_ptr, any_ptr, PR)


@fast_launch
@triton.jit
def _finish_kernel(
    logits_ptr, stride, vocab, temps_ptr, random_ptr, max_val_ptr, max_idx_ptr, race_val_ptr, race_idx_ptr,
    any_ptr, shift_ptr, log_total_ptr, tokens_ptr, out_lp_ptr, P: tl.constexpr, PR: tl.constexpr,
    PR_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    parts = row * P + tl.arange(0, P)
    _, greedy = _first_max(tl.load(max_val_ptr + parts), tl.load(max_idx_ptr + parts))
    j = tl.arange(0, PR_PAD)
    races = row * PR + j
    in_row = j < PR
    race_val = tl.load(race_val_ptr + races, mask=in_row, other=-1.0)  # (-1: below every ratio)
    _, raced = _first_max(race_val, tl.load(race_idx_ptr + races, mask=in_row, other=_BIG))
    usable = (tl.max(tl.load(any_ptr + races, mask=in_row, other=0), axis=0) > 0) & (
        tl.load(random_ptr + row) != 0
    )
    token = tl.where(usable, raced, greedy)
    r = tl.div_rn(1.0, tl.load(temps_ptr + row))
    # (token < vocab always: a row of NaN or -inf logits takes its first id; the mask is a guard)
    x = tl.load(logits_ptr + row * stride + token, mask=token < vocab, other=float("nan")).to(tl.float32)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(out_lp_ptr + row, (x * r - tl.load(shift_ptr + row)) - tl.load(log_total_ptr + row))


WRITE_BLOCK = 4096  # ids per program of `_log_softmax_kernel`


@fast_launch
@triton.jit
def _log_softmax_kernel(
    x_ptr, stride, vocab, ones_ptr, max_val_ptr, log_total_ptr, out_ptr, out_stride,
    P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out = (x * 1 - m) - log(total) over a block of ids: the sampler's log-prob, every id."""
    row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r, m = _row_shift(max_val_ptr, row, ones_ptr, P)
    ids = blk * BLOCK + tl.arange(0, BLOCK)
    mask = ids < vocab
    x = tl.load(x_ptr + row * stride + ids, mask=mask, other=0.0).to(tl.float32)
    out = (x * r - m) - tl.load(log_total_ptr + row)
    tl.store(out_ptr + row * out_stride + ids, out.to(out_ptr.dtype.element_ty), mask=mask)
