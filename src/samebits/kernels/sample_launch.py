"""The host side of the fused sample kernels (`sample_triton.py`): their launchers.

`sample` (the plain decode sample, five launches), `race` (the race over a row's changed
probabilities, one launch and per-row picks) and `log_softmax` (four launches) check their
inputs (`supported`, `race_supported`), size the per-program partials from the vocabulary
(`_shape`: S strided elements of L lanes, C lanes, P programs a row) and launch the kernels in
order. The bits are the kernels' (`sample_triton.py`'s docstring says which roundings).

Shapes: N = rows, V = vocabulary.
"""

from __future__ import annotations

import torch

from samebits.kernels.grid import cdiv, next_power_of_2
from samebits.kernels.reduce_triton import _INTERPRET, MAX_WIDTH
from samebits.kernels.sample_triton import (
    _BIG,
    LANES,
    RACE_BLOCK,
    STRIDED,
    WRITE_BLOCK,
    _finish_kernel,
    _log_softmax_kernel,
    _max_kernel,
    _race_kernel,
    _race_probs_kernel,
    _sum_kernel,
    _total_kernel,
)


def _shape(vocab: int) -> tuple[int, int, int, int]:
    """-> (S, L, C, P): strided elements per lane, lanes per program, lanes, programs per row."""
    c = next_power_of_2(vocab) // STRIDED
    return STRIDED, LANES, c, max(c // LANES, 1)


def supported(logits: torch.Tensor) -> bool:
    """2-D CUDA logits of a float dtype whose padded row W (the next power of two) splits
    into S = 64 strided elements of L = 128 to MAX_WIDTH lanes: V in (4096, 524288]."""
    if logits.dim() != 2 or not (logits.is_cuda or _INTERPRET) or not logits.dtype.is_floating_point:
        return False
    return LANES <= _shape(logits.shape[1])[2] <= MAX_WIDTH


def sample(
    logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, random_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V], temps [N] float32 (1 for greedy rows), keys [N, 2] int64, random_row [N]
    bool -> (tokens [N] int64, float32 log-probs [N]): `composite.sample_plain` on CUDA inside
    `batch_invariant()`, bit for bit."""
    if not supported(logits):
        raise ValueError(
            f"sample (Triton) needs 2-D float CUDA logits of {STRIDED * LANES // 2 + 1} to "
            f"{MAX_WIDTH * STRIDED} tokens, "
            f"got {tuple(logits.shape)} {logits.dtype} on {logits.device}"
        )
    n, vocab = logits.shape
    dev = logits.device
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    out_lp = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return tokens, out_lp
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temps = temps.to(dev, torch.float32).contiguous()
    keys = keys.to(dev, torch.int64).contiguous()
    random_row = random_row.to(dev, torch.int8).contiguous()
    s, lanes, c, p = _shape(vocab)
    f32 = dict(dtype=torch.float32, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    max_val, max_idx = torch.empty(n, p, **f32), torch.empty(n, p, **i32)
    pr = cdiv(vocab, RACE_BLOCK)  # the race's programs per row (contiguous ids)
    race_val, race_idx, positive = (
        torch.empty(n, pr, **f32),
        torch.empty(n, pr, **i32),
        torch.empty(n, pr, **i32),
    )
    lane_sums = torch.empty(n, c, **f32)
    shift, log_total = torch.empty(n, **f32), torch.empty(n, **f32)
    tile = dict(S=s, L=lanes, C=c, P=p, num_warps=8, enable_fp_fusion=False)
    stride = logits.stride(0)
    _max_kernel[(n, p)](logits, stride, vocab, max_val, max_idx, **tile)
    _sum_kernel[(n, p)](logits, stride, vocab, temps, max_val, lane_sums, **tile)
    _total_kernel[(n,)](lane_sums, log_total, C=c, num_warps=8)
    _race_kernel[(n, pr)](
        logits, stride, vocab, temps, keys, max_val, race_val, race_idx, positive, shift, log_total,
        P=p, PR=pr, BLOCK=RACE_BLOCK, num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    _finish_kernel[(n,)](
        logits, stride, vocab, temps, random_row, max_val, max_idx, race_val, race_idx, positive, shift,
        log_total, tokens, out_lp, P=p, PR=pr, PR_PAD=next_power_of_2(pr), num_warps=1,
        enable_fp_fusion=False,
    )  # fmt: skip
    return tokens, out_lp


def race_supported(probs: torch.Tensor) -> bool:
    """2-D float32 CUDA probabilities with unit stride along the row, whose ids (int32, a whole
    last block of RACE_BLOCK included) stay below 2**31 - 1."""
    return (
        probs.dim() == 2
        and (probs.is_cuda or _INTERPRET)
        and probs.dtype == torch.float32
        and 0 < probs.shape[1] <= _BIG.value - RACE_BLOCK
        and probs.stride(1) == 1
    )


def race(
    lps: torch.Tensor, probs: torch.Tensor, scores: torch.Tensor, keys: torch.Tensor, random_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.sample.race` bit for bit (the same noise, IEEE division, libdevice log and
    argmax rules as torch's CUDA ops), with the noise made in registers: one launch over
    the probabilities, then per-row picks over [N, V / RACE_BLOCK] partials, where the op-by-op
    race writes ~450 bytes of int64 temporaries per (row, token)."""
    if not race_supported(probs):
        raise ValueError(
            f"race (Triton) needs 2-D float32 CUDA probabilities with unit stride, got {tuple(probs.shape)} "
            f"{probs.dtype} on {probs.device} (strides {probs.stride()})"
        )
    n, vocab = probs.shape
    dev = probs.device
    pr = cdiv(vocab, RACE_BLOCK)
    race_val = torch.empty(n, pr, dtype=torch.float32, device=dev)
    race_idx, positive = (torch.empty(n, pr, dtype=torch.int32, device=dev) for _ in range(2))
    if n:
        keys = keys.to(dev, torch.int64).contiguous()
        _race_probs_kernel[(n, pr)](
            probs, probs.stride(0), vocab, keys, race_val, race_idx, positive, PR=pr, BLOCK=RACE_BLOCK,
            num_warps=8, enable_fp_fusion=False,
        )  # fmt: skip
    # the first block holding the row's best (NaN the largest: torch.argmax's rule) has its lowest id
    raced = race_idx.gather(1, torch.argmax(race_val, dim=1, keepdim=True))[:, 0].long()
    usable = (positive > 0).any(dim=1) & random_row
    tokens = torch.where(usable, raced, torch.argmax(scores, dim=-1))
    return tokens, lps.gather(1, tokens[:, None])[:, 0]


def log_softmax(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`log_softmax_ref(x, -1, out_dtype)` of rows x [N, V] (where `supported(x)`) in four
    launches: `_max_kernel`, `_sum_kernel` and `_total_kernel` as the sampler runs them at
    T = 1 (r = 1/1 = 1, so x * r is x), then every id's `(x - m) - log(total)`, rounded once
    to out_dtype. The composite's bits inside batch_invariant() (the same roundings as the
    sampler's log-prob, module docstring); it reads x three times and allocates only the
    output, where the composite builds three [N, V] float32 temporaries."""
    if not supported(x):
        raise ValueError(
            f"log_softmax (Triton) needs 2-D float CUDA rows of {STRIDED * LANES // 2 + 1} to "
            f"{MAX_WIDTH * STRIDED} elements, got {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    n, vocab = x.shape
    out = torch.empty(n, vocab, dtype=out_dtype, device=x.device)
    if n == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    s, lanes, c, p = _shape(vocab)
    f32 = dict(dtype=torch.float32, device=x.device)
    ones = torch.ones(n, **f32)
    max_val, max_idx = torch.empty(n, p, **f32), torch.empty(n, p, dtype=torch.int32, device=x.device)
    lane_sums, log_total = torch.empty(n, c, **f32), torch.empty(n, **f32)
    tile = dict(S=s, L=lanes, C=c, P=p, num_warps=8, enable_fp_fusion=False)
    stride = x.stride(0)
    _max_kernel[(n, p)](x, stride, vocab, max_val, max_idx, **tile)
    _sum_kernel[(n, p)](x, stride, vocab, ones, max_val, lane_sums, **tile)
    _total_kernel[(n,)](lane_sums, log_total, C=c, num_warps=8)
    _log_softmax_kernel[(n, cdiv(vocab, WRITE_BLOCK))](
        x, stride, vocab, ones, max_val, log_total, out, out.stride(0),
        P=p, BLOCK=WRITE_BLOCK, num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    return out
