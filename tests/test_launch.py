"""`kernels.launch.fast_launch`: a bound launch meets the kernel Triton would have picked.

The first test needs Triton only (its specializer runs on the host); the others a GPU."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

triton = pytest.importorskip("triton")


def _values():
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1]
    ints += [-(2**31) - 16, 2**63 - 16, 2**63 - 1, 2**63, 2**64 - 16, 2**64, 2**64 + 16, -(2**63) - 16]
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base[i:] for i in range(6)] + [base.bfloat16()[i:] for i in range(10)]
    tensors += [torch.zeros(8, dtype=torch.int64)[i:] for i in range(3)]
    return ints + [True, False, None, 0.5, 1.0, -3.0] + tensors


def test_arg_class_partitions_at_least_as_finely_as_tritons_specializer():
    """Two arguments of one `_arg_class` always get one Triton specialization, so a bound key
    never meets a kernel compiled for another. Control: the class without the 16-divisibility
    bit merges arguments Triton tells apart."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from samebits.kernels.launch import _arg_class

    def spec(x):  # None where Triton refuses the value (ints past u64 or below i64)
        try:
            return native_specialize_impl(BaseBackend, x, False, True, True)
        except (ValueError, TypeError, OverflowError):
            return None

    values = _values()
    for x, y in itertools.combinations(values, 2):
        if _arg_class(x) == _arg_class(y):
            assert spec(x) == spec(y), (x, y, spec(x), spec(y))

    def coarse(x):  # the control: forgets what 16 divides
        c = _arg_class(x)
        return c[:-1] if isinstance(x, (int, torch.Tensor)) and not isinstance(x, bool) else c

    pairs = itertools.combinations(values, 2)
    assert [(x, y) for x, y in pairs if coarse(x) == coarse(y) and spec(x) != spec(y)]


class _StubJIT:
    """Enough of a `JITFunction` for `FastLaunch`: k(x_ptr, n, BLOCK: constexpr, FLAG: constexpr).
    Indexing it records a launch through Triton's path and returns a stub compiled kernel."""

    def __init__(self):
        from types import SimpleNamespace

        names = [("x_ptr", False), ("n", False), ("BLOCK", True), ("FLAG", True)]
        self.params = [SimpleNamespace(name=n, is_constexpr=c) for n, c in names]
        self.arg_names = [n for n, _ in names]
        self.pre_run_hooks = []
        self.triton_calls, self.bound_calls = [], []
        outer = self

        class Compiled:
            function, packed_metadata = object(), object()

            def run(self, *a):
                outer.bound_calls.append(a[9:])  # the kernel's arguments, after grid..hooks

        self.compiled = Compiled()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.triton_calls.append((args, kwargs)) or self.compiled


@pytest.fixture
def stub(monkeypatch):
    from samebits.kernels.launch import FastLaunch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    fn = _StubJIT()
    return fn, FastLaunch(fn)


def test_bound_call_passes_every_parameter_in_order(stub):
    fn, k = stub
    x = torch.zeros(4)
    k[(1,)](x, 7, BLOCK=16, FLAG=True)
    k[(1,)](x, 7, FLAG=True, BLOCK=16)  # another keyword order: another key, Triton again
    k[(1,)](x, 9, BLOCK=16, FLAG=True)  # 9 and 7: one class
    assert len(fn.triton_calls) == 2 and fn.bound_calls == [(x, 9, 16, True)]
    k[(1,)](x, 9, BLOCK=32, FLAG=True)  # a constexpr's value is in the key
    assert len(fn.triton_calls) == 3 and len(fn.bound_calls) == 1


def test_what_keeps_tritons_path(stub):
    """A constexpr by position (16 and 32 share a class: binding would reuse the wrong kernel),
    a runtime parameter by keyword, an argument without a class, a pre-run hook."""
    fn, k = stub
    x = torch.zeros(4)
    for _ in range(2):
        k[(1,)](x, 7, 16, FLAG=True)
        k[(1,)](x, 7, 32, FLAG=True)
        k[(1,)](x, n=7, BLOCK=16, FLAG=True)
        k[(1,)](x, (7, 8), BLOCK=16, FLAG=True)
    assert len(fn.triton_calls) == 8 and fn.bound_calls == []
    k[(1,)](x, 7, BLOCK=16, FLAG=True)
    fn.pre_run_hooks.append(print)
    k[(1,)](x, 7, BLOCK=16, FLAG=True)
    assert len(fn.triton_calls) == 10 and fn.bound_calls == []


def test_arg_class_refuses_what_it_cannot_classify():
    from samebits.kernels.launch import _arg_class

    with pytest.raises(TypeError, match="no specialization class"):
        _arg_class("a string")


@pytest.mark.gpu
def test_bound_launch_runs_the_compiled_kernel_with_the_arguments_in_order(monkeypatch):
    """After the first call, calls with the same key skip Triton's `run` and give the first
    call's bits; a misaligned view (another key) goes through Triton again."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from samebits.kernels import matmul_triton as mt
    from samebits.kernels.launch import FastLaunch

    if not isinstance(mt.matmul_kernel, FastLaunch):
        pytest.skip("fast launch is off here (SAMEBITS_FAST_LAUNCH=0, or a Triton not in CHECKED_TRITON)")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(40, 300, device="cuda", generator=g).bfloat16()
    w = torch.randn(300, 200, device="cuda", generator=g).bfloat16()
    first = mt.matmul(a, w, tiles=(32, 32, 4, 3))  # through Triton: compiles and binds
    calls = []
    run = type(mt.matmul_kernel.fn).run
    monkeypatch.setattr(type(mt.matmul_kernel.fn), "run", lambda *x, **k: calls.append(1) or run(*x, **k))
    again = mt.matmul(a, w, tiles=(32, 32, 4, 3))
    assert calls == [] and torch.equal(again, first)
    bias = torch.randn(200, device="cuda", generator=g).bfloat16()
    with_bias = mt.matmul(a, w, bias, tiles=(32, 32, 4, 3))  # another key (HAS_BIAS): Triton once
    assert calls == [1] and torch.equal(mt.matmul(a, w, bias, tiles=(32, 32, 4, 3)), with_bias) and calls == [1]
    shifted = torch.empty(40 * 300 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(40, 300).copy_(a)
    assert shifted.data_ptr() % 16 != 0
    assert torch.equal(mt.matmul(shifted, w, tiles=(32, 32, 4, 3)), first) and calls == [1, 1]
    want = a.double() @ w.double()
    assert ((first.double() - want).abs() / (want.abs() + 1)).max() < 1e-2  # bf16 output: ~4e-3


@pytest.mark.gpu
def test_bound_launch_steps_aside_for_launch_hooks(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from triton import knobs

    from samebits.kernels import matmul_triton as mt

    a = torch.randn(8, 64, device="cuda").bfloat16()
    w = torch.randn(64, 32, device="cuda").bfloat16()
    mt.matmul(a, w)
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        mt.matmul(a, w)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert len(seen) == 1


def test_fast_launch_is_on_for_the_checked_triton(monkeypatch):
    """On a Triton release in CHECKED_TRITON every launched kernel wears it; on another, or with
    SAMEBITS_FAST_LAUNCH=0, the decorator hands the JIT function back."""
    from samebits.kernels import launch
    from samebits.kernels import matmul_triton as mt

    checked = triton.__version__.startswith(launch.CHECKED_TRITON)
    if os.environ.get("SAMEBITS_FAST_LAUNCH", "1") != "0":
        assert isinstance(mt.matmul_kernel, launch.FastLaunch) == checked
    jit = getattr(mt.matmul_kernel, "fn", mt.matmul_kernel)
    monkeypatch.setattr(triton, "__version__", "99.0.0")
    assert launch.fast_launch(jit) is jit
    monkeypatch.setattr(triton, "__version__", launch.CHECKED_TRITON[0] + "0")
    monkeypatch.setenv("SAMEBITS_FAST_LAUNCH", "0")
    assert launch.fast_launch(jit) is jit
    monkeypatch.delenv("SAMEBITS_FAST_LAUNCH")
    assert isinstance(launch.fast_launch(jit), launch.FastLaunch)


def test_every_fast_launch_kernel_takes_its_runtime_parameters_before_its_constexprs():
    """A launch is bound only when every runtime argument comes by position and every constexpr
    by keyword (`FastLaunch._first`), so a runtime parameter after a constexpr (say an optional
    tensor descriptor given by keyword) would keep that kernel on Triton's ~4 us slower path at
    every launch, silently. Every samebits kernel under `fast_launch` is checked. Control: a
    kernel with a trailing runtime parameter is found."""
    import importlib
    import pkgutil

    import triton.language as tl

    import samebits.kernels as kernels
    from samebits.kernels.launch import FastLaunch

    if os.environ.get("SAMEBITS_FAST_LAUNCH", "1") == "0":
        pytest.skip("SAMEBITS_FAST_LAUNCH=0: the kernels are plain JIT functions")

    def late(k):
        params = k.fn.params
        first = next((i for i, p in enumerate(params) if p.is_constexpr), len(params))
        return [p.name for p in params[first:] if not p.is_constexpr]

    found = {}
    for m in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"samebits.kernels.{m.name}")
        found.update({f"{m.name}.{n}": k for n, k in vars(mod).items() if isinstance(k, FastLaunch)})
    want = {"matmul_triton.matmul_kernel", "experts_triton.gate_up_kernel", "experts_triton.down_kernel"}
    assert want <= set(found)
    assert {name: late(k) for name, k in found.items() if late(k)} == {}

    @triton.jit
    def trailing(x_ptr, N: tl.constexpr, desc=None):
        pass

    assert late(FastLaunch(trailing)) == ["desc"]
