"""Refuse a transformers whose numerics-bearing pieces no longer compute the engine's bits.

samebits' engine computes, op for op, what transformers' Qwen3-MoE and Qwen3-Omni modules
compute (`numerics/ops.py` names the module each op mirrors). A new transformers release can
change one of those modules, or a wrapper can put other code in its place (a hub kernel:
`trainer/hub_kernels.py`); the trainer's log-probs would then differ from the engine's without
anything failing. `check_transformers_numerics(model)` runs, once per model and before any
work, a small probe of each piece on the model's own modules and device, inside
`batch_invariant()`, against the engine's op:

| piece | the trainer's module | the engine's op |
|---|---|---|
| RMSNorm | each norm class of the decoder layers and the final norm | `ops.rms_norm` |
| rotary | the text model's `rotary_emb` (M-RoPE for Omni) | `ops.rotary_cos_sin` / `ops.mrope_cos_sin` |
| rotary application | the `apply_rotary_pos_emb` the attention calls | `ops.apply_rotary` |
| router | the MoE block's `gate` | its linear, then `ops.router` |
| residual order | a decoder layer | its own sub-modules, pre-norm, one residual add each |
| deepstack add | the thinker text model's `_deepstack_process` | `ops.deepstack_add` |
| log-prob line | `trainer/line.py` at T 0.7, 1.0, 1.3 | `ops.reported_logprobs` |

Random inputs (a fixed seed), 64 tokens, random weights near the checkpoint's scale: on the
tiny model the whole check takes some milliseconds; on a 48-layer model one decoder layer's
forward dominates it. A piece that differs raises `TransformersDriftError` naming the piece,
the module, the transformers version and how many of the probe's values differ.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import transformers
from torch import nn
from torch.func import functional_call

from samebits.numerics import ops
from samebits.numerics.batch_invariant import batch_invariant
from samebits.trainer import line
from samebits.trainer.forwards import _Swapped, forward_globals
from samebits.trainer.hub_kernels import switch_back

_TOKENS = 64
_TEMPERATURES = (0.7, 1.0, 1.3)
_PROBED: weakref.WeakSet = weakref.WeakSet()  # models that passed


class TransformersDriftError(RuntimeError):
    """A transformers module no longer computes what samebits' engine computes."""


def check_transformers_numerics(model: nn.Module) -> None:
    """Switch hub kernels back (with a warning), then probe each numerics-bearing piece of
    `model` against the engine's op (module docstring); raise TransformersDriftError naming
    the first piece that differs. Once per model: a model that passed is not probed again."""
    switch_back(model)
    if model in _PROBED:
        return
    with _unswapped(model), torch.no_grad(), batch_invariant():
        for probe in _probes(model) if not _sharded(model) else [lambda: _probe_line(_param(model).device)]:
            probe()
    _PROBED.add(model)


def _sharded(model: nn.Module) -> bool:
    """Whether FSDP2 (`fully_shard`) shards `model`: its modules' parameters are gathered and
    cast only inside the sharded module's forward hooks, so a probe calling sub-modules one by
    one would compare a bf16 layer with float32 shards. Such a model gets the log-prob line's
    probe only; its modules are probed on the unsharded copy before sharding (`rl/fsdp.py`
    checks the host model; a user sharding their own calls this before `fully_shard`)."""
    fsdp = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    return fsdp is not None and any(isinstance(m, fsdp) for m in model.modules())


def _probes(model: nn.Module):
    """One callable per piece present in `model` (a model without Qwen3-form decoder layers,
    which samebits' forwards leave alone but for its linears, gets the log-prob line's only)."""
    layers = [m for m in model.modules() if _is_decoder_layer(m)]
    text_models = [m for m in model.modules() if any(_is_decoder_layer(c) for c in getattr(m, "layers", ()))]
    if not layers or not text_models:  # no Qwen3-form decoder (a model of other modules)
        return [lambda: _probe_line(_param(model).device)] if any(True for _ in model.parameters()) else []
    text = text_models[0]
    norms = {}
    for layer in layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            norms.setdefault(type(getattr(layer, name)), (f"layers.*.{name}", getattr(layer, name)))
        for name in ("q_norm", "k_norm"):
            if hasattr(layer.self_attn, name):
                norms.setdefault(
                    type(getattr(layer.self_attn, name)), (f"self_attn.{name}", getattr(layer.self_attn, name))
                )
    if isinstance(getattr(text, "norm", None), nn.Module):
        norms.setdefault(type(text.norm), ("norm", text.norm))
    probes = [lambda where=where, m=m: _probe_norm(where, m) for where, m in norms.values()]
    rotary = getattr(text, "rotary_emb", None)
    if rotary is not None:
        probes.append(lambda: _probe_rotary(rotary, layers[0]))
    routers = [layer.mlp.gate for layer in layers if hasattr(getattr(layer.mlp, "gate", None), "top_k")]
    if routers:
        probes.append(lambda: _probe_router(routers[0]))
    if rotary is not None:
        probes.append(lambda: _probe_layer(layers[0], rotary))
    if hasattr(text, "_deepstack_process"):
        probes.append(lambda: _probe_deepstack(text))
    probes.append(lambda: _probe_line(_param(layers[0]).device))
    return probes


def _is_decoder_layer(m: nn.Module) -> bool:
    return all(
        isinstance(getattr(m, a, None), nn.Module)
        for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    )


def _param(module: nn.Module) -> torch.Tensor:
    return next(module.parameters())


@contextlib.contextmanager
def _unswapped(model: nn.Module):
    """transformers' own classes for the probe's duration (a module samebits swapped runs
    samebits' kernels inside the context: the probe is of transformers' code)."""
    swapped = [(m, type(m)) for m in model.modules() if isinstance(m, _Swapped)]
    for m, cls in swapped:
        m.__class__ = cls._samebits_base
    try:
        yield
    finally:
        for m, cls in swapped:
            m.__class__ = cls


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(20261206)


def _randn(shape, like: torch.Tensor, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, device=like.device, dtype=torch.float32) * scale
    return x.to(like.dtype)


def _refuse(piece: str, module: str, got, want) -> None:
    got = got if isinstance(got, tuple | list) else (got,)
    want = want if isinstance(want, tuple | list) else (want,)
    differ = total = 0
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape or g.dtype != w.dtype:
            raise TransformersDriftError(
                f"transformers {transformers.__version__}: {module} ({piece}) returns "
                f"{tuple(g.shape)} {g.dtype} where samebits' engine has {tuple(w.shape)} {w.dtype}; "
                "samebits does not follow this transformers release: install the version in "
                "scripts/constraints.txt"
            )
        differ += int((g != w).sum())
        total += w.numel()
    if differ:
        raise TransformersDriftError(
            f"transformers {transformers.__version__}: {module} ({piece}) differs from samebits' "
            f"engine in {differ}/{total} values of a {_TOKENS}-token probe; the trainer's log-probs "
            "would not be the engine's. samebits does not follow this transformers release (or "
            "this module was replaced): install the version in scripts/constraints.txt"
        )


def _probe_norm(where: str, norm: nn.Module) -> None:
    w = norm.weight
    gen = _generator(w.device)
    weight = (1 + _randn(w.shape, w, gen, 0.1).float()).to(w.dtype)
    x = _randn((_TOKENS, w.shape[-1]), w, gen)
    got = functional_call(norm, {"weight": weight}, (x,))
    want = ops.rms_norm(x, weight, norm.variance_epsilon)
    _refuse("RMSNorm", f"{type(norm).__name__} at {where}", got, want)


def _positions(rotary: nn.Module, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, 4096, (1,), generator=gen, device=device)
    pos = (start + torch.arange(_TOKENS, device=device))[None]  # [1, T]
    if hasattr(rotary, "mrope_section"):  # T/H/W rows [3, 1, T]
        return torch.stack([pos, pos // 2, pos % 7 + start])
    return pos


def _rotary_want(rotary: nn.Module, x: torch.Tensor, pos: torch.Tensor):
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if hasattr(rotary, "mrope_section"):
        return ops.mrope_cos_sin(x, pos, rotary.inv_freq, scaling, list(rotary.mrope_section))
    return ops.rotary_cos_sin(x, pos, rotary.inv_freq, scaling)


def _probe_rotary(rotary: nn.Module, layer: nn.Module) -> None:
    w = _param(layer)
    gen = _generator(w.device)
    x = _randn((1, _TOKENS, w.shape[-1]), w, gen)
    pos = _positions(rotary, w.device, gen)
    piece = "M-RoPE" if hasattr(rotary, "mrope_section") else "rotary"
    cos, sin = rotary(x, pos)
    _refuse(piece, type(rotary).__name__, (cos, sin), _rotary_want(rotary, x, pos))
    attn = layer.self_attn
    apply = _rotary_function(attn)
    d = cos.shape[-1]
    q = _randn((1, _TOKENS, max(1, getattr(attn.config, "num_attention_heads", 1)), d), w, gen).transpose(1, 2)
    k = _randn((1, _TOKENS, max(1, getattr(attn.config, "num_key_value_heads", 1)), d), w, gen).transpose(1, 2)
    _refuse(
        "rotary application",
        f"apply_rotary_pos_emb of {type(attn).__name__}",
        apply(q, k, cos, sin),
        ops.apply_rotary(q, k, cos, sin),
    )


def _rotary_function(attn: nn.Module):
    """The `apply_rotary_pos_emb` the attention's forward calls: its own kernel wrapper
    (kernels' `use_kernelized_func`) or its module's global."""
    own = attn.__dict__.get("_kernel_funcs", {}).get("apply_rotary_pos_emb")
    if own is not None:
        return own
    apply = forward_globals(attn).get("apply_rotary_pos_emb")
    if apply is None:
        raise TransformersDriftError(
            f"transformers {transformers.__version__}: {type(attn).__name__}'s module has no "
            "apply_rotary_pos_emb; samebits does not follow this transformers release: install "
            "the version in scripts/constraints.txt"
        )
    return apply


def _probe_router(router: nn.Module) -> None:
    w = router.weight
    gen = _generator(w.device)
    weight = _randn(w.shape, w, gen, 0.02)
    x = _randn((_TOKENS, w.shape[-1]), w, gen)
    got = functional_call(router, {"weight": weight}, (x,))
    logits = nn.functional.linear(x, weight)
    want = (logits, *ops.router(logits, router.top_k, router.norm_topk_prob))
    _refuse("router", type(router).__name__, tuple(got), want)


def _first(out):
    return out[0] if isinstance(out, tuple | list) else out


def _probe_layer(layer: nn.Module, rotary: nn.Module) -> None:
    """The decoder layer against its own sub-modules in the engine's order: pre-norm, then one
    residual add per block, each rounded in the activations' dtype."""
    w = _param(layer)
    gen = _generator(w.device)
    x = _randn((1, _TOKENS, layer.input_layernorm.weight.shape[-1]), w, gen)
    text_pos = torch.arange(_TOKENS, device=w.device)[None]  # one sequence from position 0
    pe = rotary(x, text_pos.expand(3, 1, _TOKENS) if hasattr(rotary, "mrope_section") else text_pos)
    args = {"attention_mask": None, "position_ids": text_pos, "position_embeddings": pe}
    got = _first(layer(x, **args))
    h = x + _first(layer.self_attn(hidden_states=layer.input_layernorm(x), **args))
    want = h + _first(layer.mlp(layer.post_attention_layernorm(h)))
    _refuse("residual order", type(layer).__name__, got, want)


def _probe_deepstack(text: nn.Module) -> None:
    w = _param(text)
    gen = _generator(w.device)
    hidden = _randn((1, _TOKENS, w.shape[-1]), w, gen)
    mask = torch.rand((1, _TOKENS), generator=gen, device=w.device) < 0.4
    embeds = _randn((int(mask.sum()), w.shape[-1]), w, gen)
    got = text._deepstack_process(hidden, mask, embeds)
    _refuse(
        "deepstack add",
        f"{type(text).__name__}._deepstack_process",
        got,
        ops.deepstack_add(hidden, mask, embeds),
    )


def _probe_line(device: torch.device) -> None:
    gen = _generator(device)
    logits = (torch.randn((_TOKENS, 1024), generator=gen, device=device) * 4).to(torch.bfloat16)
    for t in _TEMPERATURES:
        got = line.trainer_logprobs(logits, t)
        _refuse(
            f"log-prob line at T={t}",
            "samebits.trainer.line.trainer_logprobs",
            got,
            ops.reported_logprobs(logits, [t]),
        )
