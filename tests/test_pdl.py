"""Programmatic dependent launch between the decode kernels (`kernels/pdl.py`): on by default
where supported; every decode kernel waits for the kernel before it before touching memory. Needs
Triton (skipped without: CI installs none); the engine with it on is a GPU test."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

pytest.importorskip("triton")

from samebits.kernels import (  # noqa: E402
    attention_triton,
    experts_triton,
    matmul_triton,
    norm_rope_triton,
    pdl,
    router_one_launch,
)

DECODE_KERNELS = [
    matmul_triton.matmul_kernel,
    norm_rope_triton.rms_norm_kernel,
    norm_rope_triton.qk_norm_rope_cache_kernel,
    attention_triton.attention_kernel,
    attention_triton.combine_kernel,
    router_one_launch.router_kernel,
    experts_triton.route_kernel,
    experts_triton.gate_up_kernel,
    experts_triton.down_kernel,
]


def _jit(kernel):
    return getattr(kernel, "fn", kernel)  # under fast_launch, the JIT function


@pytest.mark.parametrize("kernel", DECODE_KERNELS, ids=lambda k: _jit(k).__name__)
def test_each_decode_kernel_waits_before_its_first_statement(kernel):
    """`pdl_wait(PDL)` is the first statement after the docstring, so a kernel launched with
    PDL reads and writes nothing before the kernel before it has finished, but for an
    `if PREFETCH:` block that only calls `prefetch_rows_l2` (an L2 hint, no load or store);
    `PDL` and `PREFETCH` default to False (the launch as it was); `pdl_release(PDL)` comes later,
    and `pdl_release_early` only after the wait (else kernels would cascade)."""
    jit = _jit(kernel)
    fn = ast.parse(inspect.cleandoc("\n" + jit.src) if jit.src.startswith(" ") else jit.src).body[0]
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if isinstance(body[0], ast.If):
        assert ast.unparse(body[0].test) == "PREFETCH" and not body[0].orelse
        calls = [n for n in ast.walk(body[0]) if isinstance(n, ast.Call)]
        allowed = {"prefetch_rows_l2", "tl.minimum", "tl.program_id", "tl.arange"}
        assert {ast.unparse(c.func) for c in calls} <= allowed
        body = body[1:]
    assert ast.unparse(body[0]) == "pdl_wait(PDL)", ast.unparse(body[0])
    assert "pdl_release(PDL)" in ast.unparse(fn)
    assert "pdl_release_early" not in ast.unparse(fn).split("pdl_wait(PDL)")[0]
    for name in ("PDL", "PREFETCH", "EARLY"):
        param = next((p for p in jit.params if p.name == name), None)
        assert param is not None or name != "PDL"
        assert param is None or (param.is_constexpr and param.default is False)


def test_launch_args_are_empty_unless_enabled_on_a_supported_device(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_args(torch.device("cuda", 0)) == {}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_args(torch.device("cpu")) == {}
    monkeypatch.setattr(pdl, "_cuda_supported", lambda index: True)
    assert pdl.launch_args(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_cuda_supported", lambda index: False)  # before Hopper, ROCm, interpreter
    assert pdl.launch_args(torch.device("cuda", 0)) == {}


def test_early_release_only_for_grids_of_one_program_per_sm_and_with_prefetch_on(monkeypatch):
    """EARLY (`pdl_release_early`) is asked for a grid that fits the SMs once, so that the
    next kernel's programs only take SMs this one leaves idle; never with PREFETCH off or PDL off."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "PREFETCH", True)
    monkeypatch.setattr(pdl, "_cuda_supported", lambda index: True)
    monkeypatch.setattr(pdl, "sm_count", lambda device: 132)
    assert pdl.launch_args(cuda, 1)["EARLY"] and pdl.launch_args(cuda, 132)["EARLY"]
    assert pdl.launch_args(cuda, 133) == {"PDL": True, "launch_pdl": True, "EARLY": False}
    assert pdl.prefetch_on(cuda)
    monkeypatch.setattr(pdl, "PREFETCH", False)
    assert pdl.launch_args(cuda, 1)["EARLY"] is False and not pdl.prefetch_on(cuda)
    monkeypatch.setattr(pdl, "PREFETCH", True)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_args(cuda, 1) == {} and not pdl.prefetch_on(cuda)


def test_rows_prefetchable_needs_contiguous_16_byte_aligned_rows():
    """The bulk prefetch takes 16-byte aligned starts and lengths: a weight [N, K] seen as b = W.T
    (K, N) has contiguous columns (stride 1 along K); a misaligned start, row stride or length,
    or a strided column, is refused (the launcher then leaves PREFETCH off)."""
    assert pdl.rows_prefetchable(1 << 20, 4096, 4096, 1)
    assert not pdl.rows_prefetchable((1 << 20) + 2, 4096, 4096, 1)
    assert not pdl.rows_prefetchable(1 << 20, 4098, 4096, 1)
    assert not pdl.rows_prefetchable(1 << 20, 4096, 4094, 1)
    assert not pdl.rows_prefetchable(1 << 20, 4096, 4096, 2048)


def test_pdl_off_compiles_the_calls_out_and_on_emits_them_for_sm90():
    """The matmul kernel for sm_90: with PDL False its PTX has no griddepcontrol (the kernel as
    it was before PDL existed); with PDL True, one wait and one launch_dependents."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    jit = _jit(matmul_triton.matmul_kernel)
    sig = {n: ("*bf16" if n.endswith("_ptr") else "i32") for n in jit.arg_names}
    counts = {}
    for on in (False, True):
        consts = dict(HAS_BIAS=False, IEEE=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=8, PDL=on)
        consts.update(PREFETCH=False)
        sig.update({c: "constexpr" for c in consts})
        ptx = compile(ASTSource(jit, dict(sig), consts), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        counts[on] = (ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents"))
    assert counts == {False: (0, 0), True: (1, 1)}, counts


def test_prefetch_and_early_release_compile_where_they_are_meant_to_for_sm90():
    """sm_90 PTX: the matmul with PREFETCH issues its bulk L2 prefetches before its wait (and none
    without PREFETCH); the norm with EARLY lets the next kernel launch right after its wait,
    before any load (without EARLY: only after its reduction)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    target = GPUTarget("cuda", 90, 32)
    jit = _jit(matmul_triton.matmul_kernel)
    sig = {n: ("*bf16" if n.endswith("_ptr") else "i32") for n in jit.arg_names}
    for on in (False, True):
        consts = dict(HAS_BIAS=False, IEEE=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, GROUP_M=8, PDL=True)
        consts.update(PREFETCH=on)
        sig.update({c: "constexpr" for c in consts})
        ptx = compile(ASTSource(jit, dict(sig), {**consts, "stride_bk": 1}), target=target).asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        assert ("cp.async.bulk.prefetch.L2.global" in ptx[:wait]) == on
        assert "cp.async.bulk.prefetch" not in ptx[wait:]
    jit = _jit(norm_rope_triton.rms_norm_kernel)
    sig = {n: ("*bf16" if n.endswith("_ptr") else "i32") for n in jit.arg_names}
    sig.update(inv_n="fp32", eps="fp32")
    for early in (False, True):
        consts = dict(HAS_RES=True, BLOCK=2048, SLOTS=0, PDL=True, EARLY=early)
        sig.update({c: "constexpr" for c in consts})
        ptx = compile(ASTSource(jit, dict(sig), consts), target=target, options={"num_warps": 4}).asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        first_release = ptx.index("griddepcontrol.launch_dependents")
        assert ("ld.global" not in ptx[wait:first_release]) == early
