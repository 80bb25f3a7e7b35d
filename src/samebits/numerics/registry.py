"""The ops registry: which implementation each samebits op runs, per device and profile.

This module is the one place that chooses. `TABLE` maps op -> device -> profile ->
implementation; nothing else in samebits branches on the device or reads a flag to pick
a kernel. The profile is the calling thread's (`Profile.context()`, `numerics.scope`;
"exact" by default); the device is chosen by torch.library's per-device registration.

How an op is registered (follow this for a new op):

1. Kernels live in `samebits.kernels` and import nothing above it: `foo_ref` (portable
   torch: the CPU path and the test oracle) and `foo_triton.foo` (the CUDA launcher).
2. Add a row to `TABLE`: `{"cpu": {profile: impl}, "cuda": {profile: impl}}`, `ANY` for
   "every profile". CUDA entries are `_lazy("samebits.kernels.foo_triton", "foo")`, imported
   on first call, so a machine without CUDA never imports Triton. A rule that depends on
   the inputs (a width, a dtype) is a small named function below the table, its reason in
   a comment.
3. Declare the op once, in `samebits.numerics.ops`, as a `torch.library.custom_op` whose
   body is `pick("foo", "cpu")(...)`; `@foo.register_kernel("cuda")` returns
   `pick("foo", "cuda")(...)`; `@foo.register_fake` gives shapes only; an op that is trained
   through adds `register_autograd`. Export it as `EagerOp(foo, lambda device: pick("foo",
   device))` (`numerics/eager_op.py`): eager calls then skip custom_op's Python wrappers,
   with an autograd.Function over the same kernel and backward (`grad=`) if it is trained.

The aten overrides of `batch_invariant()` follow the same table: `matmul`, `bmm` and
`tree_sum` below are what its mm/addmm/bmm and sum/mean/softmax overrides run per device.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from samebits.kernels.experts import experts_ref, experts_ref_slots, experts_stock_ref, sum_slots_ref
from samebits.kernels.experts_backward import experts_backward, pointwise_ref
from samebits.kernels.experts_tiles import slot_tree_fits
from samebits.kernels.matmul import adjacent_rows, bmm_ref, matmul_ref
from samebits.kernels.norm_backward import qk_norm_rope_backward_ref, rms_norm_backward_ref
from samebits.kernels.reduce import tree_sum_ref
from samebits.kernels.sample import race
from samebits.kernels.softmax import log_softmax_ref
from samebits.numerics import composite, scope

ANY = "*"
DEVICES = ("cpu", "cuda")


def _lazy(module: str, name: str) -> Callable:
    """A CUDA implementation, imported on its first call (Triton is imported only on CUDA)."""

    loaded: list = []  # the module once `import_module` has returned (~2 us a call even when imported)

    def call(*args, **kwargs):  # the name looked up per call: tests patch the module
        if not loaded:
            loaded.append(importlib.import_module(module))
        return getattr(loaded[0], name)(*args, **kwargs)

    call.__qualname__ = f"{module}.{name}"
    return call


@functools.cache
def triton_available() -> bool:
    """Whether the CUDA implementations can run here (CUDA and Triton both present). Asked on
    every op call of several paths, so answered once per process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


# -- rules that depend on the inputs ------------------------------------------------------------

_TREE_CUDA = _lazy("samebits.kernels.reduce_triton", "tree_sum")
_FUSED_NORM = _lazy("samebits.kernels.norm_rope_triton", "rms_norm")
_FUSED_ROTARY = _lazy("samebits.kernels.norm_rope_triton", "apply_rotary")
_EXPERTS_TRITON = _lazy("samebits.kernels.experts_launch", "experts_forward")


def _tree_sum_cuda(x, dim=-1, keepdim=False):
    """One Triton launch for float32 rows of 1..8192 elements; `tree_sum_ref` (same bits) otherwise."""
    from samebits.kernels.reduce_triton import MAX_WIDTH

    if x.dtype == torch.float32 and x.dim() and 1 <= x.shape[dim] <= MAX_WIDTH:
        return _TREE_CUDA(x, dim, keepdim)
    return tree_sum_ref(x, dim, keepdim)


# The fused norms give transformers' bits under batch_invariant() (tests/test_gpu_kernels.py, at
# widths 2048, 128, 96 and 24); outside batch_invariant() the exact profile is transformers' stock
# composite, whose mean is aten's.
def _norm_fits(x) -> bool:
    from samebits.kernels.reduce_triton import MAX_WIDTH  # the widest row its tree reduces

    return triton_available() and x.shape[-1] <= MAX_WIDTH


def _rms_norm_exact_cuda(x, weight, eps):
    if scope.invariant_depth() and _norm_fits(x):
        return _FUSED_NORM(x, weight, eps)
    return composite.rms_norm(x, weight, eps)


def _add_rms_norm_exact_cuda(x, residual, weight, eps):
    if scope.invariant_depth() and residual.dtype == x.dtype and _norm_fits(x):
        return _FUSED_NORM(x, weight, eps, residual=residual)
    return composite.add_rms_norm(x, residual, weight, eps)


def _rms_norm_fast_cuda(x, weight, eps):
    return _FUSED_NORM(x, weight, eps) if _norm_fits(x) else composite.rms_norm(x, weight, eps)


def _add_rms_norm_fast_cuda(x, residual, weight, eps):
    if residual.dtype == x.dtype and _norm_fits(x):
        return _FUSED_NORM(x, weight, eps, residual=residual)
    return composite.add_rms_norm(x, residual, weight, eps)


# The fused rotary gives transformers' bits (elementwise: the same in or out of batch_invariant()).
def _apply_rotary_cuda(q, k, cos, sin, unsqueeze_dim=1):
    from samebits.kernels.norm_rope_triton import rotary_supported

    if triton_available() and rotary_supported(q, k, cos, unsqueeze_dim):
        return _FUSED_ROTARY(q, k, cos, sin)
    return composite.apply_rotary(q, k, cos, sin, unsqueeze_dim)


_FUSED_QK = _lazy("samebits.kernels.norm_rope_triton", "qk_norm_rope_cache")


def _qk_norm_rope_cache_composite(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots):
    """q/k RMSNorm, rotary, K/V cache writes, op by op (each op the registry's own choice)."""
    dev = q.device.type
    q = pick("rms_norm", dev)(q, q_weight, eps)
    k = pick("rms_norm", dev)(k, k_weight, eps)
    q, k = pick("apply_rotary", dev)(q, k, cos, sin, 1)
    k_cache[slots] = k
    v_cache[slots] = v
    return q


def _fused_qk_ok(q, k, v, q_weight, k_weight, cos, k_cache, v_cache) -> bool:
    if not triton_available():
        return False
    from samebits.kernels.norm_rope_triton import qk_norm_rope_cache_supported

    return qk_norm_rope_cache_supported(q, k, v, q_weight, k_weight, cos, k_cache, v_cache)


# the fused norms' tree is transformers' bits inside batch_invariant() only (see the norms above)
def _qk_norm_rope_cache_exact_cuda(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots):
    if scope.invariant_depth() and _fused_qk_ok(q, k, v, q_weight, k_weight, cos, k_cache, v_cache):
        return _FUSED_QK(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots)
    return _qk_norm_rope_cache_composite(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots)


def _qk_norm_rope_cache_fast_cuda(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots):
    if _fused_qk_ok(q, k, v, q_weight, k_weight, cos, k_cache, v_cache):
        return _FUSED_QK(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots)
    return _qk_norm_rope_cache_composite(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots)


def _projections_separate(x, weights):
    return tuple(F.linear(x, w) for w in weights)


def _projections_one_gemm(x, weights):
    """One GEMM over weights lying back to back in one storage, split into each one's columns;
    separate GEMMs otherwise. The Triton matmul's column bits do not depend on N (each column's
    K order is BLOCK_K and the K loop alone; tests/test_gpu_kernels.py); MKL's do, measured, so
    the CPU keeps separate GEMMs."""
    joined = adjacent_rows(weights)
    if joined is None:
        return _projections_separate(x, weights)
    return F.linear(x, joined).split([w.shape[0] for w in weights], dim=-1)


# exact: one GEMM only where batch_invariant() routes it to the Triton matmul (cuBLAS picks
# its algorithm by shape); fast: always
def _projections_exact_cuda(x, weights):
    if scope.invariant_depth():
        return _projections_one_gemm(x, weights)
    return _projections_separate(x, weights)


def _linears_separate(x, weights):
    return tuple(matmul_ref(x, w.t()) for w in weights)


_MATMUL_TRITON = _lazy("samebits.kernels.matmul_triton", "matmul")


def _linears_joined_cuda(x, weights):
    """One Triton GEMM over the weights joined (a view where they lie back to back, else a
    copy: the trainer's separate parameters), split into each one's columns. A column's bits do
    not depend on N (`_projections_one_gemm`)."""
    joined = adjacent_rows(list(weights))
    if joined is None:
        joined = torch.cat(weights)
    return _MATMUL_TRITON(x, joined.t()).split([w.shape[0] for w in weights], dim=-1)


def _experts_triton(x, index, weights, gate_up, down):
    return _EXPERTS_TRITON(x, index, weights.contiguous(), gate_up, down)


_NORM_BACKWARD_TRITON = _lazy("samebits.kernels.norm_backward_triton", "rms_norm_backward")
_ROUTE_TRITON = _lazy("samebits.kernels.experts_launch", "route_pairs")
_POINTWISE_TRITON = _lazy("samebits.kernels.experts_backward_triton", "pointwise")


def _experts_pointwise_cuda(gate_up, u, order, weights, want_dw):
    from samebits.kernels.experts_backward_triton import supported

    if supported(gate_up, u, order, weights):
        return _POINTWISE_TRITON(gate_up, u, order, weights, want_dw)
    return pointwise_ref(gate_up, u, order, weights, want_dw)


def _experts_backward_cuda(grad_out, x, index, weights, gate_up, down, wants):
    """The closed form, routed by the forward's one launch (`experts_launch.route_pairs`: the
    order and offsets of `experts.route`) where the torch route is ~8 host ops, its elementwise
    middle one launch (`experts_backward_triton.pointwise`) where the torch form is ~15."""
    return experts_backward(
        grad_out,
        x,
        index,
        weights,
        gate_up,
        down,
        wants,
        route_pairs=_ROUTE_TRITON,
        pointwise=_experts_pointwise_cuda,
    )


def _rms_norm_backward_cuda(grad, x, weight, eps, wants):
    """One Triton launch for rows of up to 8192 elements; the torch closed form otherwise."""
    from samebits.kernels.norm_backward_triton import supported

    if triton_available() and supported(x):
        return _NORM_BACKWARD_TRITON(grad, x, weight, eps, wants)
    return rms_norm_backward_ref(grad, x, weight, eps, wants)


_QK_BACKWARD_TRITON = _lazy("samebits.kernels.norm_rope_backward_triton", "qk_norm_rope_backward")


def _qk_norm_rope_backward_cuda(dq, dk, dv, q, k, q_weight, k_weight, eps, cos, sin, wants):
    """One Triton launch where its layout fits; the torch closed form otherwise."""
    from samebits.kernels.norm_rope_backward_triton import supported

    if triton_available() and supported(dq, dk, dv, q, k, q_weight, k_weight, cos, sin):
        return _QK_BACKWARD_TRITON(dq, dk, dv, q, k, q_weight, k_weight, eps, cos, sin, wants)
    return qk_norm_rope_backward_ref(dq, dk, dv, q, k, q_weight, k_weight, eps, cos, sin, wants)


# batch_invariant imports this module (triton_available), so its context is looked up at call time
_BATCH_INVARIANT = _lazy("samebits.numerics.batch_invariant", "batch_invariant")


def _grads_by_recompute(recompute: Callable, invariant: bool) -> Callable:
    """An experts backward that recomputes the forward with differentiable ops (inside
    batch_invariant() when `invariant`) and lets autograd differentiate it -> the
    gradients of (hidden, weights, gate_up, down), None where not wanted."""

    def backward(grad_out, x, index, weights, gate_up, down, wants):
        with torch.enable_grad():
            inputs = (x, weights, gate_up, down)
            leaves = [t.detach().requires_grad_(w) for t, w in zip(inputs, wants, strict=True)]
            with _BATCH_INVARIANT() if invariant else contextlib.nullcontext():
                out = recompute(leaves[0], index, leaves[1], leaves[2], leaves[3])
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
        return tuple(next(grads) if t.requires_grad else None for t in leaves)

    return backward


def _experts_ref_twin(x, index, weights, gate_up, down):
    """`experts_ref` through differentiable ops (`F.linear`); inside batch_invariant() its GEMMs are
    `matmul_ref`, so it recomputes `experts_ref`'s forward bits with an autograd graph."""
    return experts_ref(x, index, weights, gate_up, down, linear=F.linear)


def _divide_by_temperatures(x: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """x [N, V] float32 / temps [N]: what `x / T` (T a Python float) does on the CPU."""
    return x / temps[:, None]


def _multiply_by_reciprocals(x: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """x [N, V] float32 * (1 / temps) [N]: what `x / T` does on CUDA, where aten multiplies by
    the float32 reciprocal of a scalar divisor (BinaryDivTrueKernel.cu); `reciprocal` is an
    IEEE division, so 1 / T has the host's bits."""
    return x * torch.reciprocal(temps)[:, None]


_FUSED_SAMPLE = _lazy("samebits.kernels.sample_launch", "sample")


def _sample_cpu(logits, temps, keys, random_row):
    return composite.sample_plain(logits, temps, keys, random_row, _divide_by_temperatures)


def _fused_sample_ok(logits) -> bool:
    if not triton_available():
        return False
    from samebits.kernels.sample_launch import supported

    return supported(logits)


# The fused sample gives the composite's bits inside batch_invariant() (the exact profile's
# log-softmax is the fixed tree it reproduces); outside it the composite runs aten's stock
# log_softmax, so the exact profile keeps the composite there. The fast profile takes the
# fused kernel always (its bits are not the contract, its speed is).
def _sample_exact_cuda(logits, temps, keys, random_row):
    if scope.invariant_depth() and _fused_sample_ok(logits):
        return _FUSED_SAMPLE(logits, temps, keys, random_row)
    return composite.sample_plain(logits, temps, keys, random_row, _multiply_by_reciprocals)


def _sample_fast_cuda(logits, temps, keys, random_row):
    if _fused_sample_ok(logits):
        return _FUSED_SAMPLE(logits, temps, keys, random_row)
    return composite.sample_plain(logits, temps, keys, random_row, _multiply_by_reciprocals)


_FUSED_RACE = _lazy("samebits.kernels.sample_launch", "race")


def _race_cuda(lps, probs, scores, keys, random_row):
    """The race over given probabilities: on CUDA one launch with the noise in registers
    (`sample_launch.race`, the composite's bits: integer noise, IEEE division, libdevice log,
    argmax's rules), else op by op (`kernels.sample.race`)."""
    if triton_available():
        from samebits.kernels.sample_launch import race_supported

        if race_supported(probs):
            return _FUSED_RACE(lps, probs, scores, keys, random_row)
    return race(lps, probs, scores, keys, random_row)


_FUSED_LOG_SOFTMAX = _lazy("samebits.kernels.sample_launch", "log_softmax")
_LOG_SOFTMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _log_softmax_cuda(x, dim, out_dtype, tree):
    """batch_invariant()'s log_softmax on CUDA: over the last dim of a float32/bf16/fp16 x with
    rows of 4097..524288 elements, the fused kernels (`sample_launch.log_softmax`: the
    sampler's log-prob for every id, the same roundings as the composite, no [N, V]
    temporaries); else the composite with the device's tree."""
    if x.dim() >= 1 and dim in (-1, x.dim() - 1) and x.dtype in _LOG_SOFTMAX_DTYPES:  # else aten's checks
        rows = x.reshape(-1, x.shape[-1])
        if _fused_sample_ok(rows):
            return _FUSED_LOG_SOFTMAX(rows, out_dtype).view(x.shape)
    return log_softmax_ref(x, dim, out_dtype, tree)


_ROUTER_FOUR_LAUNCHES = _lazy("samebits.kernels.router_triton", "router")
_ROUTER_ONE_LAUNCH = _lazy("samebits.kernels.router_one_launch", "router")


def _fused_router(router_logits, top_k, norm_topk_prob):
    """One launch where `torch.topk`'s CUDA tie order is written out and was checked on a GPU
    against this torch (`topk_order.order_checked`); else the softmax and renorm kernels
    around `torch.topk` itself. Both give the composite's bits inside batch_invariant()."""
    from samebits.kernels.topk_order import order_checked

    if order_checked(top_k):
        return _ROUTER_ONE_LAUNCH(router_logits, top_k, norm_topk_prob)
    return _ROUTER_FOUR_LAUNCHES(router_logits, top_k, norm_topk_prob)


def _fused_router_ok(router_logits, top_k) -> bool:
    if not triton_available():
        return False
    from samebits.kernels.router_triton import supported

    return supported(router_logits, top_k)


# The fused router gives the composite's bits inside batch_invariant() (its softmax and renorm
# sums are the fixed tree there; kernels/router_triton.py); outside it the composite runs
# aten's stock softmax and sum, so the exact profile keeps the composite there.
def _router_exact_cuda(router_logits, top_k, norm_topk_prob):
    if scope.invariant_depth() and _fused_router_ok(router_logits, top_k):
        return _fused_router(router_logits, top_k, norm_topk_prob)
    return composite.router(router_logits, top_k, norm_topk_prob)


def _router_fast_cuda(router_logits, top_k, norm_topk_prob):
    if _fused_router_ok(router_logits, top_k):
        return _fused_router(router_logits, top_k, norm_topk_prob)
    return composite.router(router_logits, top_k, norm_topk_prob)


# -- a MoE layer's top-k sum in the next norm's launch --------------------------------------------
# The experts hand the next norm their weighted slot outputs [T, K, H] fp32; the norm sums them
# (the experts' tree, rounded once), adds the residual and normalizes in one launch. On CUDA that
# is `norm_rope_triton.slot_add_rms_norm`; its GPU tests (tests/test_gpu_kernels.py -k slot: the
# kernel against the two launches, the engine with it against without) passed on the H200
# (docs/performance.md, 2026-12-04). False is the way back to the experts' own sum
# (`experts_slots` answers None).
SLOTS_ON_CUDA = True


def _no_slots(x, index, weights, gate_up, down):
    return None


def _experts_slots_cuda(x, index, weights, gate_up, down):
    if not SLOTS_ON_CUDA or not slot_tree_fits(index.shape[-1]) or not triton_available():
        return None
    return _EXPERTS_TRITON(x, index, weights.contiguous(), gate_up, down, sum_slots=False)


def _sum_slots_cuda(slots, dtype):
    if not triton_available():
        return sum_slots_ref(slots, dtype)
    from samebits.kernels.experts_launch import slot_sum

    return slot_sum(slots, dtype)


def _slot_add_rms_norm_separate(slots, residual, weight, eps):
    """The experts' sum, then the registry's add_rms_norm (two launches on CUDA)."""
    device = residual.device.type
    return pick("add_rms_norm", device)(pick("sum_slots", device)(slots, residual.dtype), residual, weight, eps)


def _slot_norm_fits(slots, residual) -> bool:
    return slot_tree_fits(slots.shape[1]) and slots.is_contiguous() and _norm_fits(residual)


# exact: fused inside batch_invariant() only (outside it the composite's mean is aten's), as
# add_rms_norm; fast: wherever it fits
def _slot_add_rms_norm_exact_cuda(slots, residual, weight, eps):
    if scope.invariant_depth() and _slot_norm_fits(slots, residual):
        return _FUSED_SLOT_NORM(slots, residual, weight, eps)
    return _slot_add_rms_norm_separate(slots, residual, weight, eps)


def _slot_add_rms_norm_fast_cuda(slots, residual, weight, eps):
    if _slot_norm_fits(slots, residual):
        return _FUSED_SLOT_NORM(slots, residual, weight, eps)
    return _slot_add_rms_norm_separate(slots, residual, weight, eps)


_FUSED_SLOT_NORM = _lazy("samebits.kernels.norm_rope_triton", "slot_add_rms_norm")


# -- the table ----------------------------------------------------------------------------------

TABLE: dict[str, dict[str, dict[str, Callable]]] = {
    # fixed-order sum over one dim (batch_invariant()'s sum, mean and softmax overrides)
    "tree_sum": {"cpu": {ANY: tree_sum_ref}, "cuda": {ANY: _tree_sum_cuda}},
    # row-invariant GEMMs (batch_invariant()'s mm, addmm, bmm overrides)
    "matmul": {"cpu": {ANY: matmul_ref}, "cuda": {ANY: _MATMUL_TRITON}},
    # (x [M, K], weights [N_i, K]) -> x @ w_i.T each, on the row-invariant matmul (the trainer's
    # q/k/v inside batch_invariant()): on CUDA one GEMM over the weights joined; on the CPU one
    # each (MKL's column bits depend on N)
    "linears": {"cpu": {ANY: _linears_separate}, "cuda": {ANY: _linears_joined_cuda}},
    "bmm": {"cpu": {ANY: bmm_ref}, "cuda": {ANY: _lazy("samebits.kernels.matmul_triton", "bmm")}},
    # a layer's q/k RMSNorm, rotary and K/V cache writes: on CUDA one fused launch
    "qk_norm_rope_cache": {
        "cpu": {ANY: _qk_norm_rope_cache_composite},
        "cuda": {"exact": _qk_norm_rope_cache_exact_cuda, "fast": _qk_norm_rope_cache_fast_cuda},
    },
    # x @ w_i.T for weights sharing x (a layer's q/k/v): on CUDA one GEMM when they are adjacent
    "projections": {
        "cpu": {ANY: _projections_separate},
        "cuda": {"exact": _projections_exact_cuda, "fast": _projections_one_gemm},
    },
    # batch_invariant()'s log_softmax (x, dim, out dtype, the device's tree sum): on CUDA the
    # sampler's kernels over the vocabulary
    "log_softmax": {"cpu": {ANY: log_softmax_ref}, "cuda": {ANY: _log_softmax_cuda}},
    # the MoE router after its linear (softmax, top-k, renorm, cast): on CUDA one launch
    # (torch.topk's order checked on this torch) or two around torch.topk
    "router": {
        "cpu": {ANY: composite.router},
        "cuda": {"exact": _router_exact_cuda, "fast": _router_fast_cuda},
    },
    # MoE experts before their top-k sum ([T, K, H] fp32, or None where a device or profile has
    # no such step: then the model calls `experts`)
    "experts_slots": {
        "cpu": {"exact": experts_ref_slots, "fast": _no_slots},
        "cuda": {"exact": _experts_slots_cuda, "fast": _experts_slots_cuda},
    },
    # (slots, dtype) -> the experts' closing top-k sum
    "sum_slots": {"cpu": {ANY: sum_slots_ref}, "cuda": {ANY: _sum_slots_cuda}},
    # (slots, residual, weight, eps) -> (residual + sum, norm): on CUDA one launch
    "slot_add_rms_norm": {
        "cpu": {ANY: _slot_add_rms_norm_separate},
        "cuda": {"exact": _slot_add_rms_norm_exact_cuda, "fast": _slot_add_rms_norm_fast_cuda},
    },
    # MoE experts: samebits' batch-invariant kernels (exact); the fast profile: the stock twin on
    # the CPU; on CUDA the Triton kernel too, faster than torch's grouped_mm at every size
    # measured (1..4096 tokens; H200, 2026-12-03, docs/performance.md)
    "experts": {
        "cpu": {"exact": experts_ref, "fast": experts_stock_ref},
        "cuda": {"exact": _experts_triton, "fast": _experts_triton},
    },
    # (grad_out, x, index, weights, gate_up, down, wants) -> the four gradients. CPU: autograd
    # through a recompute of the forward (the exact twin's bits inside batch_invariant()); CUDA:
    # the closed form on grouped GEMMs, stock kernels (gradients carry no bitwise contract)
    "experts_backward": {
        "cpu": {
            "exact": _grads_by_recompute(_experts_ref_twin, invariant=True),
            "fast": _grads_by_recompute(experts_stock_ref, invariant=False),
        },
        "cuda": {ANY: _experts_backward_cuda},
    },
    # (grad, x, weight, eps, wants) -> (dx, dw): the closed form, stock arithmetic (no bitwise
    # contract); on CUDA one fused launch (trainer/forwards.py's RMSNorm backward)
    "rms_norm_backward": {"cpu": {ANY: rms_norm_backward_ref}, "cuda": {ANY: _rms_norm_backward_cuda}},
    # (dq, dk, dv, q, k, q_weight, k_weight, eps, cos, sin, wants) -> (d[q; k; v], d q_weight,
    # d k_weight): the backward of `qk_norm_rope_cache`'s norms and rotary, closed form, stock
    # arithmetic; on CUDA one launch (the trainer's attention block)
    "qk_norm_rope_backward": {
        "cpu": {ANY: qk_norm_rope_backward_ref},
        "cuda": {ANY: _qk_norm_rope_backward_cuda},
    },
    "rms_norm": {
        "cpu": {ANY: composite.rms_norm},
        "cuda": {"exact": _rms_norm_exact_cuda, "fast": _rms_norm_fast_cuda},
    },
    "add_rms_norm": {
        "cpu": {ANY: composite.add_rms_norm},
        "cuda": {"exact": _add_rms_norm_exact_cuda, "fast": _add_rms_norm_fast_cuda},
    },
    # `logits.float() / T` with T a Python float, row by row (the reported log-prob's scaling):
    # each device's rounding of the trainer's line, whatever the profile
    "temperature_scale": {"cpu": {ANY: _divide_by_temperatures}, "cuda": {ANY: _multiply_by_reciprocals}},
    # the plain decode sample (no banned tokens, top-k/top-p or top log-probs): the reported
    # log-probs and the exponential race; on CUDA one fused kernel family (kernels/sample_triton.py)
    "sample_plain": {
        "cpu": {ANY: _sample_cpu},
        "cuda": {"exact": _sample_exact_cuda, "fast": _sample_fast_cuda},
    },
    # the exponential race over given (narrowed, banned) probabilities: the sampler's rows with
    # rules; on CUDA one launch (kernels/sample_triton.py), no order to keep (argmaxes, integers)
    "race": {"cpu": {ANY: race}, "cuda": {ANY: _race_cuda}},
    "apply_rotary": {
        "cpu": {ANY: composite.apply_rotary},
        "cuda": {ANY: _apply_rotary_cuda},
    },
}


def pick(op: str, device: str, profile: str | None = None) -> Callable:
    """The implementation of `op` on `device` ("cpu" or "cuda") under `profile` (default: the
    calling thread's profile)."""
    by_profile = TABLE[op][device]
    name = profile or scope.profile_name()
    if name in by_profile:
        return by_profile[name]
    if ANY in by_profile:
        return by_profile[ANY]
    raise KeyError(f"ops registry: {op!r} has no {device} implementation for profile {name!r}")
