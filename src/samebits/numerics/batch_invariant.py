"""`batch_invariant()`: row-invariant aten kernels for the thread that enters it.

Inside the context, in the thread that entered it, the aten ops below run samebits'
fixed-order kernels, so a row's result never depends on how many other rows share the
call. The rollout engine runs its forward inside it; the trainer wraps its recompute in it,
so both sides reach every GEMM and every reduction through the same kernels. Autograd sits
above the overrides, so a backward on the same thread (the CPU) goes through them too; on
CUDA autograd runs the backward on its own device thread, which gets stock kernels.

The overrides are registered once per process (on the first entry, CPU and, where Triton and
CUDA are present, CUDA). Each checks the calling thread's flag (`numerics.scope`): a thread
that is not inside the context gets the stock kernel (the kernel that was registered before,
called as it was), so entering per step costs a counter, and other threads are untouched.

| aten op                                     | inside `batch_invariant()`                          |
|---------------------------------------------|-----------------------------------------------------|
| mm, addmm (alpha=beta=1), bmm               | row-invariant GEMM (CPU `matmul_ref`, CUDA Triton)  |
| mm.out, addmm.out, addmm_, the out_dtype=   | the same GEMM, copied into `out` (TRL's fused head: |
|   overloads (mm/addmm .dtype, .dtype_out)   |   `mm(out=tile)`, `addmm(out_dtype=fp32, out=acc)`) |
| mv, dot                                     | the same GEMM with N=1                              |
| _softmax, _log_softmax                      | max, exp, tree sum over the dim (fp32)              |
| _log_softmax on CUDA: last dim 4097-524288  | the same bits in 4 fused launches (`sample_triton`; |
|   of a fp32, bf16 or fp16 tensor            |   fp32 math, one rounding to the out dtype)         |
| sum.dim_IntList, mean.dim (any dims, all)   | tree sum over the reduced dims flattened (fp32)     |
| logsumexp                                   | max, exp, tree sum, log (aten's infinite-max rule)  |
| var, std, var_mean, std_mean (.correction)  | two passes: tree mean, tree sum of squares          |
| native_layer_norm                           | tree mean and variance, fp32, one rounding          |
| convolution (not transposed)                | im2col + the row-invariant GEMM per group           |
| sdpa: CPU fused kernel                      | the math path on the ops above                      |
| sdpa: CUDA flash, efficient, cudnn kernels  | stock, with a one-time warning (see below)          |
| baddbmm, addbmm, addmv, _addmm_activation   | refused: `NotImplementedError` naming the op        |
| native_group_norm, nansum                   | refused                                             |
| linalg_vector_norm, transposed convolution  | refused                                             |

Integer and bool sums keep the stock kernel (exact in any order). Ops not in the table
are elementwise, order-exact (max, min, argmax, topk) or per-row scans (cumsum).
sdpa on CUDA: transformers' `sdpa` attention is the stock negative control that samebits'
probes run inside the context, so it runs (stock) with a one-time warning; use
`attn_implementation="samebits"` (or "eager", which reaches the GEMMs above) for bits.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

from samebits.numerics import scope
from samebits.numerics.invariant_ops import covered
from samebits.numerics.registry import triton_available

REFUSED = (
    "baddbmm",
    "addbmm",
    "addmv",
    "_addmm_activation",
    "native_group_norm",
    "nansum",
    "linalg_vector_norm",
)
STOCK_WARNED_CUDA = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

_lock = threading.Lock()
_lib: torch.library.Library | None = None
_devices: tuple[str, ...] = ()  # the device types whose kernels the overrides replaced
_warned: set[str] = set()


def _refuse(name: str) -> Callable:
    def refused(*args, **kwargs):
        raise NotImplementedError(
            f"batch_invariant(): aten::{name} has no row-invariant implementation in samebits; "
            f"run it outside batch_invariant() or express it with covered ops (see "
            f"samebits.numerics.batch_invariant)"
        )

    return refused


def _warn_stock(name: str) -> Callable:
    def stock(*args, **kwargs):
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"batch_invariant(): aten::{name} (sdpa on CUDA) runs the stock fused kernel, which is "
                f"not batch invariant; use attn_implementation='samebits' for invariant attention",
                stacklevel=2,
            )
        return NotImplemented

    return stock


def _override(name: str, device: str, impl: Callable) -> Callable:
    """The kernel registered for `name` on `device`: `impl` inside the context, stock outside."""
    original = torch.library.get_kernel(f"aten::{name}", _KEYS[device])

    def kernel(keyset, *args, **kwargs):
        if scope.invariant_depth():
            out = impl(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return original.call_boxed(keyset, *args, **kwargs)

    return kernel


def _implementations(device: str) -> dict[str, Callable]:
    impls = covered(device) | {name: _refuse(name) for name in REFUSED}
    if device == "cuda":
        impls |= {name: _warn_stock(name) for name in STOCK_WARNED_CUDA}
    return impls


def _install() -> torch.library.Library:
    global _devices
    lib = torch.library.Library("aten", "IMPL")
    devices = ("cpu", "cuda") if triton_available() else ("cpu",)
    _devices = devices
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "overriding a previously registered kernel"
        for device in devices:
            for name, impl in _implementations(device).items():
                lib.impl(name, _override(name, device, impl), _KEYS[device], with_keyset=True)
    return lib


def installed() -> bool:
    """Whether the overrides are registered (they are, from the first entry on, for good)."""
    return _lib is not None


def installed_for(device_type: str) -> bool:
    """Whether the overrides replace the kernels of `device_type` ("cpu"; "cuda" where Triton is)."""
    return device_type in _devices


def is_active() -> bool:
    """Whether the calling thread is inside a `batch_invariant()` context."""
    return scope.invariant_depth() > 0


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Run the enclosed code, in this thread, with samebits' row-invariant aten kernels.

    Re-entrant and cheap (a per-thread counter); other threads keep stock kernels. Inside,
    ops without an invariant implementation raise instead of running stock (see the module
    docstring's table).
    """
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _install()
    scope.add_invariant(1)
    try:
        yield
    finally:
        scope.add_invariant(-1)
