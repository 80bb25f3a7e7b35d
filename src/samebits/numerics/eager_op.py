"""samebits' ops called eagerly without `torch.library.custom_op`'s Python wrappers.

Each op is declared once as a custom op (`numerics/ops.py`, `model/attention.py`): what
torch.compile, fake tensors, dispatch modes and `opcheck` see, opaque, so nothing fuses into it
or reorders it. Its kernels are plain functions (the registry's `pick(name, device)`, or the
op's own body). Through the op, every eager call crosses custom_op's wrappers (the dispatcher,
the autograd and backend adapters, their checks): on CI's 2-core CPU 45 us a call for an op
whose kernel takes 4, and 127 us with autograd recording (pytorch/pytorch#139500 and #177109
track it; attention-gym and TensorRT-LLM register around it). The trainer's micro-batches are
bound by host time (docs/performance.md), and it calls the experts and attention ops every
layer of every micro-batch.

An `EagerOp` is called like the op. Where calling the kernel directly cannot differ from the
op, it does: an eager call by position (no torch.compile trace, Python dispatch mode, torch
function mode, functorch transform or TorchScript trace active) whose tensors are plain
tensors (no subclass such as a fake tensor or a DTensor) on one device type the registry
covers, with no gradient to record. The kernel is
the very function the op's dispatch would have reached, on the same arguments, run below the
autograd layer as the op runs it (each aten op inside skips autograd's wrapper), so the bits
are the op's. A call that needs a gradient goes through `grad` (an autograd.Function over the
same kernel and the op's own backward) where the op has one, and through the op otherwise
(which refuses the backward, as before). Everything else goes through the op. What the direct
path does not do: the op's profiler range and its check that outputs do not alias inputs
(samebits' kernels return fresh tensors).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from samebits.numerics.registry import DEVICES

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _transformed() -> bool:
    """Something that must see the op as one call is active: a torch.compile trace, a Python
    dispatch mode (fake tensors, counters), a torch function mode (`with torch.device(...)`
    included), a functorch transform (vmap, grad) or the TorchScript tracer."""
    return (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch._C._get_tracing_state() is not None
    )


def direct_route(args: tuple) -> tuple[str | None, bool]:
    """-> (the device type whose kernel an eager call may run directly, or None: call the op;
    whether a gradient is to be recorded)."""
    if _transformed():
        return None, False
    device, grad, recording = None, False, torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN:
                return None, False
            kind = a.device.type
            if device is None:
                device = kind
            elif kind != device:
                return None, False
            grad = grad or (recording and a.requires_grad)
    return (device if device in DEVICES else None), grad


class EagerOp:
    """A custom op (`op`) and its kernels (`kernel(device)` -> the function the op runs on that
    device type); `grad`: an autograd.Function over the same kernel, for calls that record a
    gradient. Called like the op (module docstring)."""

    def __init__(
        self,
        op: Callable,
        kernel: Callable[[str], Callable],
        grad: type[torch.autograd.Function] | None = None,
    ):
        self.op, self.kernel, self.grad = op, kernel, grad
        self.__doc__ = getattr(op, "_init_fn", op).__doc__  # a CustomOpDef keeps its function there

    def __call__(self, *args, **kwargs):
        if kwargs:  # the kernels' parameter names are not the schema's: the op binds them
            return self.op(*args, **kwargs)
        device, grad = direct_route(args)
        if device is None or (grad and self.grad is None):
            return self.op(*args)
        if grad:
            return self.grad.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():  # as the op runs its kernel: no autograd layer
            return self.kernel(device)(*args)

    def __getattr__(self, name):  # register_fake, register_autograd, ... : the op's
        if name in ("op", "kernel", "grad"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        if name in ("register_kernel", "set_kernel_enabled"):
            raise AttributeError(
                f"EagerOp.{name}: eager calls run `kernel(device)` (the registry's pick), not the op's "
                "kernels; register on the op before wrapping it, and change the registry's TABLE"
            )
        return getattr(self.op, name)
