"""`torch.topk` on CUDA, ties included, written out: the order a fused router must reproduce.

The router keeps `torch.topk` between its two Triton launches (`router_triton`), so that the
experts chosen and their slot order, ties included, are the trainer's by construction. A
router in one launch must give the same order. For k <= 32, PyTorch's CUDA (not ROCm)
`topk(x, k, largest=True, sorted=True)` runs two kernels
(`aten/src/ATen/native/cuda/TensorTopK.cu`, `SortUtils.cuh`, `Sort.cu`):

1. *gather* (`sbtopk::gatherTopK`; `mbtopk` for long rows writes in the same order): find the
   k-th largest value v (radix select), then write, in index order, every element > v, then
   the elements == v, in index order, until k are written;
2. *sort* (`sortKeyValueInplace`, unstable: `SmallBitonicSort` for k <= 32): a bitonic network
   over 32 slots, the k gathered (value, index) pairs first and the rest marked invalid,
   with the comparator `a > b` and the swap rule `swap = (a > b and valid_a) or not
   valid_b; exchange when swap == dir`. Equal values may be exchanged: the network, not the
   index, orders ties.

`topk_cuda_order_ref` is that algorithm in plain Python, for rows without NaN and without
-0.0 (where the radix order and `>` disagree; a softmax gives neither). Whether it is what the
installed torch does is a GPU test (`test_gpu_router.py`), run against `torch.topk` on rows
full of ties. A torch that ordered ties by index under `use_deterministic_algorithms(True)`
(proposed upstream, not in torch 2.11-2.13) would break it; samebits never turns that on.
"""

from __future__ import annotations

import math

import torch

SORT_SLOTS = 32  # SmallBitonicSort's sort_size: every k <= 32 sorts in 32 slots

# torch releases whose CUDA torch.topk was checked on a GPU to give this order
# (test_gpu_router.py::test_torch_topk_tie_order_on_cuda_is_the_written_out_reference)
TOPK_ORDER_TORCH = ("2.11.",)


def order_checked(k: int) -> bool:
    """Whether a kernel that writes this order out gives the installed torch's `topk(x, k)`:
    CUDA (not ROCm, whose topk is another kernel) torch in TOPK_ORDER_TORCH, k <= 32."""
    return 1 <= k <= SORT_SLOTS and torch.version.hip is None and torch.__version__.startswith(TOPK_ORDER_TORCH)


def topk_cuda_order_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, E] float -> (values [T, k], indices [T, k] int64) as CUDA `torch.topk(x, k)` gives
    them (module docstring). Slow: a test oracle."""
    if x.dim() != 2 or not 1 <= k <= min(SORT_SLOTS, x.shape[1]):
        raise ValueError(
            f"topk_cuda_order_ref: x [T, E] and 1 <= k <= min(32, E), got {tuple(x.shape)} and {k}"
        )
    rows = x.detach().cpu().double().tolist()  # exact: every float32 is a double
    if any(v != v or (v == 0 and math.copysign(1.0, v) < 0) for row in rows for v in row):
        raise ValueError("topk_cuda_order_ref: rows with NaN or -0.0 are outside what it reproduces")
    values, indices = [], []
    for row in rows:
        order = _sorted_network(*_gathered(row, k))
        values.append([row[i] for i in order])
        indices.append(order)
    return torch.tensor(values, dtype=x.dtype), torch.tensor(indices, dtype=torch.int64)


def _gathered(row: list[float], k: int) -> tuple[list[float], list[int]]:
    """The gather kernel's output: elements > the k-th largest in index order, then equal ones."""
    kth = sorted(row, reverse=True)[k - 1]
    above = [i for i, v in enumerate(row) if v > kth]
    equal = [i for i, v in enumerate(row) if v == kth][: k - len(above)]
    picked = above + equal
    return [row[i] for i in picked], picked


def _sorted_network(keys: list[float], values: list[int]) -> list[int]:
    """`bitonicSort` over SORT_SLOTS slots (the k pairs, then invalid ones) -> the first k values."""
    k = len(keys)
    keys = keys + [0.0] * (SORT_SLOTS - k)
    values = values + [0] * (SORT_SLOTS - k)
    valid = [True] * k + [False] * (SORT_SLOTS - k)

    def exchange(stride: int, dir_of) -> None:  # one stage: thread t owns pair (pos, pos + stride)
        for t in range(SORT_SLOTS // 2):
            a = 2 * t - (t & (stride - 1))
            b = a + stride
            swap = (keys[a] > keys[b] and valid[a]) or not valid[b]
            if swap == dir_of(t):
                keys[a], keys[b] = keys[b], keys[a]
                values[a], values[b] = values[b], values[a]
                valid[a], valid[b] = valid[b], valid[a]

    size = 2
    while size < SORT_SLOTS:
        stride = size // 2
        while stride:
            exchange(stride, lambda t, size=size: (t & (size // 2)) != 0)
            stride //= 2
        size *= 2
    stride = SORT_SLOTS // 2
    while stride:
        exchange(stride, lambda t: False)
        stride //= 2
    return values[:k]
