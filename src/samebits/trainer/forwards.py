"""samebits' forwards for a transformers model's linears and RMSNorms: the same bits, fewer host ops.

Inside `batch_invariant()` a transformers RMSNorm is eight aten ops, its mean routed through the
overrides' Python wrapper to the tree sum, and a linear is aten's `linear` -> `mm` -> the
wrapper -> the row-invariant matmul. The trainer is bound by that host work at RL micro-batch
sizes (docs/performance.md, "The trainer is host-bound"). `use_samebits_forwards(model)`
(`trainer/swap.py`, which picks the modules) swaps each such module's class for a subclass
whose forward calls what the overrides would reach, directly:

- a bias-free `nn.Linear`: the registry's row-invariant `matmul(x, w.T)`, the very call the
  `mm` override makes for `F.linear`;
- an RMSNorm whose forward is transformers' Qwen3 one (compared by code object): the registry's
  `rms_norm` (on CUDA one fused launch; its bits are the composite's inside the context);
- an MoE router whose forward is transformers' `Qwen3MoeTopKRouter` one (by code object): its
  linear as above, then the registry's `router` (softmax, `torch.topk`, renorm, cast; on CUDA
  two Triton launches around `torch.topk`, where the module is ten aten ops behind the
  overrides; the engine's router, tested against the module in `test_gpu_router.py`).

Outside `batch_invariant()`, under autocast (which casts inputs in aten, before the overrides)
and on devices the overrides do not cover, each module runs its own forward. The
backwards are closed forms on stock kernels (gradients carry no bitwise contract): the linear's
two GEMMs on `out=` overloads (on CUDA the backward runs on autograd's device thread, where
every call of an op the overrides cover, mm, sum.dim, mean.dim, would cross their Python
wrapper), the norm's the registry's `rms_norm_backward` (on CUDA one fused launch), the router's the
softmax/renorm chain rule on the saved logits.
"""

from __future__ import annotations

import copyreg

import torch
from torch import nn

from samebits.numerics import scope
from samebits.numerics.batch_invariant import installed_for
from samebits.numerics.registry import pick


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _matmul(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])  # [M, out]
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = torch.mm(g, weight, out=g.new_empty(g.shape[0], weight.shape[1])).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = torch.mm(g.t(), x.reshape(-1, x.shape[-1]), out=torch.empty_like(weight))
        return gx, gw


def _matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T -> [..., out]: the mm override's call for `F.linear(x, weight)`."""
    out = pick("matmul", x.device.type)(x.reshape(-1, x.shape[-1]), weight.t())
    return out.view(*x.shape[:-1], weight.shape[0])


def _direct(x: torch.Tensor) -> bool:
    """Whether a swapped module calls samebits' kernels: inside batch_invariant(), on a device
    whose overrides are installed (there the module's own forward reaches the same kernels),
    and outside autocast (which casts a module's inputs in aten, before the overrides)."""
    return (
        bool(scope.invariant_depth())
        and installed_for(x.device.type)
        and not torch.is_autocast_enabled(x.device.type)
    )


def _grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _Swapped:
    """Mixin of the swapped classes. Pickled (and copied) as the transformers class it came
    from: a loaded or copied module runs transformers' forward, which has the same bits."""

    _samebits_base: type

    def __reduce_ex__(self, protocol):
        # what pickle writes for any object of the base class: no reference to samebits
        return copyreg._reconstructor, (self._samebits_base, object, None), self.__dict__.copy()


class SamebitsLinear(_Swapped, nn.Linear):
    """A bias-free `nn.Linear` whose forward calls the row-invariant matmul directly inside
    batch_invariant() (module docstring)."""

    _samebits_base = nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _direct(x) or x.dtype != self.weight.dtype:
            return super().forward(x)
        return _linear(x, self.weight)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` on samebits' matmul: through `_Linear` where gradients flow."""
    return _Linear.apply(x, weight) if _grad(x, weight) else _matmul(x, weight)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return pick("rms_norm", x.device.type)(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        wants = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        dx, dw = pick("rms_norm_backward", x.device.type)(grad, x, weight, ctx.eps, wants)
        return dx, dw, None


def _rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _direct(x):
        return self._samebits_base.forward(self, x)
    if _grad(x, self.weight):
        return _RMSNorm.apply(x, self.weight, self.variance_epsilon)
    return pick("rms_norm", x.device.type)(x, self.weight, self.variance_epsilon)


_SWAPPED_CLASSES: dict[type, type] = {}  # transformers class -> its swapped subclass


def _swapped_class(cls: type, forward) -> type:
    if cls not in _SWAPPED_CLASSES:
        _SWAPPED_CLASSES[cls] = type(
            f"Samebits{cls.__name__}",
            (_Swapped, cls),
            {"_samebits_base": cls, "forward": forward, "__module__": __name__},
        )
    return _SWAPPED_CLASSES[cls]


class _Router(torch.autograd.Function):
    """A router's linear and routing in one node: hidden [T, H], weight [E, H] -> (logits [T, E],
    weights [T, K] in the logits' dtype, indices [T, K]). Forward: the row-invariant matmul, then
    the registry's `router`. Backward: the chain rule of p = softmax(z) in fp32, v = p[indices],
    w = v / sum(v) (norm_topk_prob), on stock ops, plus the logits' own grad (an aux loss reads
    them), then the linear's two GEMMs."""

    @staticmethod
    def forward(ctx, hidden_states, weight, top_k, norm_topk_prob):
        logits = _matmul(hidden_states, weight)
        weights, index = pick("router", logits.device.type)(logits, top_k, norm_topk_prob)
        ctx.save_for_backward(hidden_states, weight, logits, index)
        ctx.norm_topk_prob = norm_topk_prob
        ctx.mark_non_differentiable(index)
        ctx.set_materialize_grads(False)  # logits nobody read (no aux loss): None, not zeros to add
        return logits, weights, index

    @staticmethod
    def backward(ctx, grad_logits, grad_weights, _grad_index):
        hidden_states, weight, logits, index = ctx.saved_tensors
        if grad_weights is None and grad_logits is None:  # neither output reached the loss
            return None, None, None, None
        if grad_weights is None:
            return _Linear.backward(_Saved(ctx, hidden_states, weight), grad_logits) + (None, None)
        z = logits.float()
        p = torch.ops.aten._softmax.out(z, -1, False, out=torch.empty_like(z))  # [T, E]
        v = p.gather(1, index)  # [T, K]
        dv = grad_weights.float()
        if ctx.norm_topk_prob:
            total = _row_sum(v)
            dv = (dv - _row_sum(dv * v) / total) / total
        dp = torch.zeros_like(p).scatter_(1, index, dv)
        dz = (p * (dp - _row_sum(dv * v))).to(logits.dtype)  # softmax: p * (dp - <dp, p>)
        if grad_logits is not None:
            dz = dz + grad_logits
        return _Linear.backward(_Saved(ctx, hidden_states, weight), dz) + (None, None)


class _Saved:
    """What `_Linear.backward` reads from its ctx, for a node that ran the linear itself."""

    def __init__(self, ctx, x, weight):
        self.saved_tensors = (x, weight)
        self.needs_input_grad = ctx.needs_input_grad[:2]


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """[T, K] -> [T, 1] on the out= overload (autograd's thread: not behind the overrides' wrapper)."""
    return torch.sum(x, -1, keepdim=True, out=x.new_empty(x.shape[0], 1))


def _router_forward(self, hidden_states: torch.Tensor):
    """transformers' `Qwen3MoeTopKRouter.forward`: -> (router_logits, weights, indices)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    if not _direct(hidden_states) or hidden_states.dtype != self.weight.dtype:
        return self._samebits_base.forward(self, hidden_states)
    if _grad(hidden_states, self.weight):
        return _Router.apply(hidden_states, self.weight, self.top_k, self.norm_topk_prob)
    logits = _matmul(hidden_states, self.weight)
    return (logits, *pick("router", logits.device.type)(logits, self.top_k, self.norm_topk_prob))


def base_forward(module: nn.Module):
    """The class forward `module` had before any swap (a swapped module's transformers class's)."""
    return type(module)._samebits_base.forward if isinstance(module, _Swapped) else type(module).forward


def forward_globals(module: nn.Module) -> dict:
    """The module globals of the function behind `module`'s class forward (where it finds
    `apply_rotary_pos_emb` and the like)."""
    fn = base_forward(module)
    while getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return getattr(fn, "__globals__", {})
