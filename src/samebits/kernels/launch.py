"""Triton launches with less host work: `@fast_launch` over `@triton.jit`.

`kernel[grid](*args, **kwargs)` through Triton 3.6's `JITFunction.run` binds and specializes
every argument, builds a cache key with `str(options)`, checks the kernel's globals, and
builds launch metadata for the launch hooks, which the C launcher then calls even when no
hook is set. On the H200's host that Python was ~4 us of a ~31 us launch
(`benchmarks/host_dispatch.py`); the trainer's small micro-batches are bound by host time
per launch (docs/performance.md, 2026-12-04).

A `fast_launch` kernel is launched the same way, `kernel[grid](...)`. Its first call with a
given key goes through Triton (which compiles or finds the kernel, and launches it); the
compiled kernel is kept under the key, and later calls with the key hand the arguments
straight to that compiled kernel's C launcher on the current stream. The key holds the
device, the keyword arguments (constexprs and launch options, by value) and, for each
positional argument, everything Triton 3.6 specializes it by (`_arg_class`, a partition at
least as fine as Triton's: `tests/test_launch.py` checks it against Triton's own
specializer), and Triton's process-wide debug and instrumentation knobs, so a key always
meets the kernel Triton would have picked. The bits are the compiled kernel's either way.
Not repeated on a bound call: Triton's check that the module globals a kernel read at
compile time have not changed since (samebits' kernels read constants only).

Triton's path is kept when a launch hook or a pre-run hook is set (profilers such as proton),
for a constexpr passed by position, an argument it has no class for, a callable grid, under
Triton's CPU interpreter, on a Triton release it was not checked against (`CHECKED_TRITON`),
and everywhere with `SAMEBITS_FAST_LAUNCH=0` in the environment (in those three
`fast_launch` returns the kernel itself): the switch for A/B timing, and the way out.
"""

from __future__ import annotations

import os

import torch
from triton import knobs

_INT32 = range(-(2**31), 2**31)
_INT64 = range(-(2**63), 2**63)
_UINT64 = range(0, 2**64)


def _arg_class(x) -> tuple:
    """What Triton specializes a runtime argument by: a tensor's dtype and 16-byte alignment;
    an int's type (i32 / i64 / u64, or none: Triton refuses it), whether it is 1 and whether
    16 divides it. TypeError for anything else (those launches keep Triton's path)."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.data_ptr() % 16 == 0)
    if isinstance(x, bool):  # before int: a bool is an int
        return ("u1",)
    if isinstance(x, int):
        return (x in _INT32, x in _INT64, x in _UINT64, x == 1, x % 16 == 0)
    if x is None:
        return (None,)
    if isinstance(x, float):
        return ("fp32",)
    raise TypeError(f"fast_launch: no specialization class for an argument of type {type(x).__name__}")


class FastLaunch:
    """A `triton.jit` kernel whose launches skip Triton's per-call binding once its key has
    been seen (module docstring). Everything else is the JIT function's (`__getattr__`).

    Only the parameters before the first constexpr may be passed by position (so no constexpr
    is ever keyed by its class instead of its value); the constexprs come by keyword, as every
    samebits launcher passes them. A launch that does otherwise keeps Triton's path."""

    def __init__(self, fn):
        self.fn = fn
        self._runtime_params = next((i for i, p in enumerate(fn.params) if p.is_constexpr), len(fn.params))
        self._constexprs = {p.name for p in fn.params if p.is_constexpr}
        self._bound: dict[tuple, tuple] = {}  # key -> (compiled kernel, tail of constexpr names)

    def __getattr__(self, name):
        if name in ("fn", "_runtime_params", "_constexprs", "_bound"):  # not set yet (copy): no recursion
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        if callable(grid) or len(args) > self._runtime_params or self.fn.pre_run_hooks or _hooks_set():
            return self.fn[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        try:
            key = (device, _options(), tuple(kwargs.items()), tuple(map(_arg_class, args)))
            hit = self._bound.get(key)
        except TypeError:  # an argument without a class, or an unhashable keyword value
            return self.fn[grid](*args, **kwargs)
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
        runtime_by_keyword = any(k in self.fn.arg_names and k not in self._constexprs for k in kwargs)
        if all(name in kwargs for name in tail) and not runtime_by_keyword:  # keys by value are constexprs
            if getattr(kernel, "function", None) is not None:  # compiled and loaded (not a future)
                self._bound[key] = (kernel, tail)
        return kernel


def _options() -> tuple:
    """The process-wide knobs Triton's `run` adds to a kernel's options (its cache key)."""
    return (knobs.runtime.debug, knobs.compilation.instrumentation_mode)


def _hooks_set() -> bool:
    return bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)


# Triton releases whose specializer `_arg_class` was checked against (tests/test_launch.py) and
# whose `JITFunction.run` / C launcher calls `FastLaunch` mirrors. Any other keeps Triton's path.
CHECKED_TRITON = ("3.6.",)


def fast_launch(fn):
    """Decorator over `@triton.jit` (see the module docstring); under Triton's CPU
    interpreter, with SAMEBITS_FAST_LAUNCH=0, or on a Triton release not in CHECKED_TRITON,
    it returns `fn` unchanged."""
    import triton
    from triton.runtime.jit import JITFunction

    if os.environ.get("SAMEBITS_FAST_LAUNCH", "1") == "0" or not triton.__version__.startswith(CHECKED_TRITON):
        return fn
    return FastLaunch(fn) if isinstance(fn, JITFunction) else fn
