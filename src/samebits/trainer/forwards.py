"""samebits' forwards for a transformers model's linears and RMSNorms: the same bits, fewer host ops.

Inside `batch_invariant()` a transformers RMSNorm is eight aten ops, its mean routed through the
overrides' Python wrapper to the tree sum, and a linear is aten's `linear` -> `mm` -> the
wrapper -> the row-invariant matmul. The trainer is bound by that host work at RL micro-batch
sizes (docs/perf-notes.md, "The trainer is host-bound"). `use_samebits_forwards(model)` gives
each such module a forward that calls what the overrides would reach, directly:

- a bias-free `nn.Linear`: the registry's row-invariant `matmul(x, w.T)`, the very call the
  `mm` override makes for `F.linear`;
- an RMSNorm whose forward is transformers' Qwen3 one (compared by code object): the registry's
  `rms_norm` (on CUDA one fused launch; its bits are the composite's inside the context).

Outside `batch_invariant()` each module runs its own forward, so stock runs stay stock. The
backwards are closed forms on stock kernels (gradients carry no bitwise contract): the linear's
two GEMMs on `out=` overloads (on CUDA the backward runs on autograd's device thread, where
every call of an op the overrides cover, mm, sum.dim, mean.dim, would cross their Python
wrapper), the norm's the registry's `rms_norm_backward` (on CUDA one fused launch).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from samebits.numerics import scope
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


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not scope.invariant_depth() or x.dtype != self.weight.dtype:
        return nn.Linear.forward(self, x)
    if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
        return _Linear.apply(x, self.weight)
    return _matmul(x, self.weight)


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


def _qwen3_rms_norm_code() -> types.CodeType:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    return Qwen3MoeRMSNorm.forward.__code__


def _is_qwen3_rms_norm(module: nn.Module, reference: types.CodeType) -> bool:
    """A module whose forward is transformers' Qwen3 RMSNorm, byte for byte (the modular
    converter copies it into each model family's file under the family's class name)."""
    code = getattr(type(module).forward, "__code__", None)
    return (
        code is not None
        and (code.co_code, code.co_consts, code.co_names)
        == (reference.co_code, reference.co_consts, reference.co_names)
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def _rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not scope.invariant_depth():
        return type(self).forward(self, x)
    if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
        return _RMSNorm.apply(x, self.weight, self.variance_epsilon)
    return pick("rms_norm", x.device.type)(x, self.weight, self.variance_epsilon)


def use_samebits_forwards(model: nn.Module) -> int:
    """Give every bias-free `nn.Linear` and every Qwen3-form RMSNorm in `model` samebits' forward
    (module docstring); -> how many modules changed. Idempotent; the parameters are untouched."""
    reference = _qwen3_rms_norm_code()
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.bias is None:
            forward = _linear_forward
        elif _is_qwen3_rms_norm(module, reference):
            forward = _rms_norm_forward
        else:
            continue
        bound = getattr(module.forward, "__func__", None)
        if bound is not forward:
            module.forward = types.MethodType(forward, module)
            changed += 1
    return changed
