"""Which modules of a transformers model get samebits' forwards, and the swap itself.

A module is swapped only when its forward is transformers' Qwen3 one for that piece. The
identity is the forward's code (bytecode, constants, names), read through what transformers
and the `kernels` package wrap around it: `functools.wraps` chains (`use_kernelized_func`
wraps an attention's forward) and the `Func` modules `use_kernel_forward_from_hub` makes of a
function (`apply_rotary_pos_emb` from transformers 5.25). A wrapper does not change the bits;
a hub kernel put in a module's place does, and `trainer/hub_kernels.py` switches those back
before anything here runs. What the identity cannot see (the same code computing other bits,
as when transformers changes a helper it calls) the probes of `trainer/drift.py` catch.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from samebits.trainer.attention_forward import attention_forward
from samebits.trainer.forwards import (
    SamebitsLinear,
    _rms_norm_forward,
    _router_forward,
    _Swapped,
    _swapped_class,
    base_forward,
    forward_globals,
)


def _code(fn) -> types.CodeType | None:
    """The code object of the function behind `fn`: through `__wrapped__` chains, bound
    methods, and kernels' `Func` modules (whose forward calls the function it was made of, held
    in its closure as `func`) -> None for anything else."""
    for _ in range(16):  # a wrapper chain is a few deep; a cycle ends here
        if fn is None:
            return None
        if getattr(fn, "__wrapped__", None) is not None:
            fn = fn.__wrapped__
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        elif isinstance(fn, nn.Module) and hasattr(type(fn), "kernel_layer_name"):
            fn = _closure_var(type(fn).forward, "func")
        else:
            return getattr(fn, "__code__", None)
    return None


def _closure_var(fn, name: str):
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def _reference_codes() -> dict[str, types.CodeType | None]:
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    return {
        "norm": _code(hf.Qwen3MoeRMSNorm.forward),
        "router": _code(hf.Qwen3MoeTopKRouter.forward),
        "attention": _code(hf.Qwen3MoeAttention.forward),
        "rotary": _code(hf.apply_rotary_pos_emb),
        "rotate_half": _code(hf.rotate_half),
    }


def _same_code(code: types.CodeType | None, reference: types.CodeType | None) -> bool:
    return (
        code is not None
        and reference is not None
        and (code.co_code, code.co_consts, code.co_names)
        == (reference.co_code, reference.co_consts, reference.co_names)
    )


def _same_forward(module: nn.Module, reference: types.CodeType | None, attrs: dict) -> bool:
    """A module whose forward is `reference`, byte for byte (the modular converter copies
    transformers' Qwen3 modules into each model family's file under the family's class names),
    holding the attributes that forward reads."""
    return _same_code(_code(base_forward(module)), reference) and all(
        isinstance(getattr(module, a, None), t) for a, t in attrs.items()
    )


_NORM_ATTRS = {"weight": torch.Tensor, "variance_epsilon": float}
_ROUTER_ATTRS = {"weight": torch.Tensor, "top_k": int, "hidden_dim": int, "norm_topk_prob": bool}
_ATTENTION_ATTRS = {"head_dim": int, "scaling": float, "attention_dropout": (int, float), "config": object}


def _qwen3_attention(module: nn.Module, codes: dict) -> bool:
    """transformers' Qwen3 attention forward (by code, the rotary it calls too) over bias-free
    linears and Qwen3 RMSNorms of one epsilon: what `attention_forward` replaces."""
    if not _same_forward(module, codes["attention"], _ATTENTION_ATTRS):
        return False
    names = forward_globals(module)
    linears = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    norms = [getattr(module, n, None) for n in ("q_norm", "k_norm")]
    return (
        _same_code(_code(names.get("apply_rotary_pos_emb")), codes["rotary"])
        and _same_code(_code(names.get("rotate_half")), codes["rotate_half"])
        and all(isinstance(m, nn.Linear) and m.bias is None for m in linears)
        and all(isinstance(m, nn.Module) and _same_forward(m, codes["norm"], _NORM_ATTRS) for m in norms)
        and norms[0].variance_epsilon == norms[1].variance_epsilon
    )


def is_qwen3_norm(module: nn.Module) -> bool:
    return _same_forward(module, _reference_codes()["norm"], _NORM_ATTRS)


def is_qwen3_router(module: nn.Module) -> bool:
    return _same_forward(module, _reference_codes()["router"], _ROUTER_ATTRS)


def use_samebits_forwards(model: nn.Module, *, check: bool = True) -> int:
    """Give every bias-free `nn.Linear`, Qwen3-form RMSNorm, router and attention in `model`
    samebits' forward (`trainer/forwards.py`) by swapping its class for a subclass -> how many
    modules changed. Idempotent; parameters, buffers and hooks are untouched; `torch.save` and
    `copy` give the transformers classes back.

    `check` first switches hub kernels back (`trainer/hub_kernels.py`) and runs the drift
    probes (`trainer/drift.py`): a transformers whose pieces no longer compute the engine's
    bits is refused here, by name, before any work."""
    if check:
        from samebits.trainer.drift import check_transformers_numerics

        check_transformers_numerics(model)
    codes = _reference_codes()
    changed = 0
    for module in model.modules():
        if isinstance(module, _Swapped):
            continue
        if type(module) is nn.Linear and module.bias is None:
            module.__class__ = SamebitsLinear
        elif _same_forward(module, codes["norm"], _NORM_ATTRS):
            module.__class__ = _swapped_class(type(module), _rms_norm_forward)
        elif _same_forward(module, codes["router"], _ROUTER_ATTRS):
            module.__class__ = _swapped_class(type(module), _router_forward)
        elif _qwen3_attention(module, codes):
            module.__class__ = _swapped_class(type(module), attention_forward)
        else:
            continue
        changed += 1
    return changed
