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
    PDL reads and writes nothing before the kernel before it has finished; `PDL` defaults to
    False (the launch as it was); `pdl_release(PDL)` comes later."""
    jit = _jit(kernel)
    fn = ast.parse(inspect.cleandoc("\n" + jit.src) if jit.src.startswith(" ") else jit.src).body[0]
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    assert ast.unparse(body[0]) == "pdl_wait(PDL)", ast.unparse(body[0])
    assert "pdl_release(PDL)" in ast.unparse(fn)
    pdl_param = next(p for p in jit.params if p.name == "PDL")
    assert pdl_param.is_constexpr and pdl_param.default is False


def test_launch_args_are_empty_unless_enabled_on_a_supported_device(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_args(torch.device("cuda", 0)) == {}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_args(torch.device("cpu")) == {}
    monkeypatch.setattr(pdl, "_cuda_supported", lambda index: True)
    assert pdl.launch_args(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_cuda_supported", lambda index: False)  # before Hopper, ROCm, interpreter
    assert pdl.launch_args(torch.device("cuda", 0)) == {}


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
        sig.update({c: "constexpr" for c in consts})
        ptx = compile(ASTSource(jit, dict(sig), consts), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        counts[on] = (ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents"))
    assert counts == {False: (0, 0), True: (1, 1)}, counts
