"""`batch_invariant()`: aten overrides that make every reduction row-invariant.

Inside the context, the CPU kernels of the ops below are replaced by samebits'
fixed-order versions, so a row's result never depends on how many other rows
share the call. The rollout engine runs its forward inside this context; the
trainer wraps its recompute in it, so both sides reach every GEMM and every
reduction through the same kernels. Autograd sits above the overrides, so
backward passes go through them too.

Overridden on CPU and, where Triton is installed, on CUDA: mm, addmm, bmm
(CPU: `matmul_ref`; CUDA: the Triton kernel in `matmul_triton`), _log_softmax,
_softmax, mean.dim and sum.dim_IntList (fixed-order trees for floating inputs
reduced over one dim; other cases keep the stock kernel).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

import torch

from samebits.kernels.matmul import bmm_ref, matmul_ref
from samebits.kernels.reduce import tree_sum
from samebits.kernels.softmax import log_softmax_ref, softmax_ref

_lock = threading.Lock()
_depth = 0
_lib: torch.library.Library | None = None


def _mm(a, b):
    return matmul_ref(a, b)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        raise NotImplementedError("samebits batch_invariant addmm supports only alpha=beta=1")
    return matmul_ref(a, b, bias)


def _bmm(a, b):
    return bmm_ref(a, b)


def _mm_cuda(a, b):
    from samebits.kernels.matmul_triton import matmul

    return matmul(a, b)


def _addmm_cuda(bias, a, b, *, beta=1, alpha=1):
    from samebits.kernels.matmul_triton import matmul

    if beta != 1 or alpha != 1:
        raise NotImplementedError("samebits batch_invariant addmm supports only alpha=beta=1")
    if bias.dim() == 1 and bias.shape[0] == b.shape[1]:
        return matmul(a, b, bias)
    return (matmul(a.float(), b.float()) + bias.float()).to(a.dtype)


def _bmm_cuda(a, b):
    from samebits.kernels.matmul_triton import bmm

    return bmm(a, b)


def _log_softmax(x, dim, half_to_float):
    return log_softmax_ref(x, dim, torch.float32 if half_to_float else x.dtype)


def _softmax(x, dim, half_to_float):
    return softmax_ref(x, dim, torch.float32 if half_to_float else x.dtype)


def _one_float_dim(x, dim) -> bool:
    return x.is_floating_point() and dim is not None and len(dim) == 1 and x.dim() > 0


def _sum_dim(x, dim, keepdim=False, *, dtype=None):
    if not _one_float_dim(x, dim) or (dtype is not None and not dtype.is_floating_point):
        # aten's own result dtype: bool and integer sums are int64 unless dtype says otherwise
        default = x.dtype if x.is_floating_point() or x.is_complex() else torch.int64
        out = torch.empty(0, dtype=dtype or default, device=x.device)
        return torch.ops.aten.sum.IntList_out(x, dim, keepdim, dtype=dtype, out=out)
    acc = x.to(dtype) if dtype is not None else x
    low = acc.dtype in (torch.bfloat16, torch.float16)
    total = tree_sum(acc.float() if low else acc, dim=dim[0], keepdim=keepdim)
    return total.to(acc.dtype)


def _mean_dim(x, dim, keepdim=False, *, dtype=None):
    if not _one_float_dim(x, dim):
        out = torch.empty(0, dtype=dtype or x.dtype, device=x.device)
        return torch.ops.aten.mean.out(x, dim, keepdim, dtype=dtype, out=out)
    acc = x.to(dtype) if dtype is not None else x
    low = acc.dtype in (torch.bfloat16, torch.float16)
    xf = acc.float() if low else acc
    n = xf.shape[dim[0]]
    return (tree_sum(xf, dim=dim[0], keepdim=keepdim) / n).to(acc.dtype)


_OVERRIDES = {
    "mm": _mm,
    "addmm": _addmm,
    "bmm": _bmm,
    "_log_softmax": _log_softmax,
    "_softmax": _softmax,
    "sum.dim_IntList": _sum_dim,
    "mean.dim": _mean_dim,
}


_CUDA_GEMMS = {"mm": _mm_cuda, "addmm": _addmm_cuda, "bmm": _bmm_cuda}


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _install() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    cuda = _OVERRIDES | _CUDA_GEMMS if triton_available() else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "overriding a previously registered kernel"
        for name, fn in _OVERRIDES.items():
            lib.impl(name, fn, "CPU")
        for name, fn in cuda.items():
            lib.impl(name, fn, "CUDA")
    return lib


def is_active() -> bool:
    """Whether a `batch_invariant()` context is open (in any thread)."""
    return _depth > 0


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Run the enclosed code with samebits' row-invariant aten kernels.

    Re-entrant. The overrides are process-wide while any context is open.
    """
    global _depth, _lib
    with _lock:
        if _depth == 0:
            _lib = _install()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _lib is not None:
                _lib._destroy()
                _lib = None
