"""Triton launches with less host work: `@fast_launch` over `@triton.jit`.

`kernel[grid](*args, **kwargs)` through Triton 3.6's `JITFunction.run` costs ~20 us of host
time a call on the H200's host (`benchmarks/host_dispatch.py`): it binds and specializes
every argument, builds a cache key with `str(options)`, checks the kernel's globals, and
builds launch metadata for the launch hooks, which the C launcher then calls even when no
hook is set. The trainer's micro-batches and the engine's eager steps are bound by exactly
that host time.

A `fast_launch` kernel is launched the same way, `kernel[grid](...)`. Its first call with a
given key goes through Triton (which compiles or finds the kernel, and launches it); the
compiled kernel is kept under the key, and later calls with the key hand the arguments
straight to that compiled kernel's C launcher on the current stream. The key holds the
device, the keyword arguments (constexprs and launch options, by value) and, for each
positional argument, everything Triton 3.6 specializes it by (`_arg_class`, a partition at
least as fine as Triton's: `tests/test_launch.py` checks it against Triton's own
specializer), so a key always meets the kernel Triton would have picked. The bits are the
compiled kernel's either way.

Triton's path is kept when a launch hook is set (profilers such as proton), for keyword
arguments that are not constexprs, under Triton's CPU interpreter, and everywhere with
`SAMEBITS_FAST_LAUNCH=0` in the environment (there `fast_launch` returns the kernel itself):
the switch for A/B timing, and the way out should a Triton release specialize otherwise.
"""

from __future__ import annotations

import os

import torch
from triton import knobs

_INT32 = range(-(2**31), 2**31)
_INT64 = range(-(2**63), 2**63)


def _arg_class(x) -> tuple:
    """What Triton specializes a runtime argument by: a tensor's dtype and 16-byte alignment;
    an int's type (i32 / i64 / u64), whether it is 1 and whether 16 divides it."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.data_ptr() % 16 == 0)
    if isinstance(x, bool):  # before int: a bool is an int
        return ("u1",)
    if isinstance(x, int):
        return (x in _INT32, x in _INT64, x == 1, x % 16 == 0)
    if x is None:
        return (None,)
    if isinstance(x, float):
        return ("fp32",)
    raise TypeError(f"fast_launch: no specialization class for an argument of type {type(x).__name__}")


class FastLaunch:
    """A `triton.jit` kernel whose launches skip Triton's per-call binding once its key has
    been seen (module docstring). Everything else is the JIT function's (`__getattr__`)."""

    def __init__(self, fn):
        self.fn = fn
        self._bound: dict[tuple, tuple] = {}  # key -> (compiled kernel, tail of constexpr names)

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        if callable(grid) or _hooks_set():
            return self.fn[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key = (device, tuple(kwargs.items()), tuple(map(_arg_class, args)))
        hit = self._bound.get(key)
        if hit is None:
            return self._first(grid, args, kwargs, key)
        kernel, tail = hit
        g = (*grid, 1, 1)
        stream = torch._C._cuda_getCurrentRawStream(device)
        kernel.run(
            g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
            *args, *(kwargs[name] for name in tail),
        )  # fmt: skip
        return kernel

    def _first(self, grid, args, kwargs, key):
        kernel = self.fn[grid](*args, **kwargs)
        tail = self.fn.arg_names[len(args) :]
        constexpr = {p.name for p in self.fn.params if p.is_constexpr}
        if all(name in kwargs for name in tail) and all(k in constexpr for k in kwargs if k in tail):
            if getattr(kernel, "function", None) is not None:  # compiled and loaded: bindable
                self._bound[key] = (kernel, tail)
        return kernel


def _hooks_set() -> bool:
    return bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)


def fast_launch(fn):
    """Decorator over `@triton.jit` (see the module docstring); under Triton's CPU
    interpreter, or with SAMEBITS_FAST_LAUNCH=0, it returns `fn` unchanged."""
    from triton.runtime.jit import JITFunction

    if os.environ.get("SAMEBITS_FAST_LAUNCH", "1") == "0":
        return fn
    return FastLaunch(fn) if isinstance(fn, JITFunction) else fn
