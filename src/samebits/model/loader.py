"""Loading a local HF Qwen3-MoE checkpoint into HF-named tensors (fused experts layout).

Accepts one `model.safetensors` or shards listed by `model.safetensors.index.json`;
experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]) or per expert (`mlp.experts.N.{gate,up,down}_proj.weight`), which are
stacked layer by layer; bf16 or fp32. Anything else is refused by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from samebits.model.config import ModelConfig, UnsupportedCheckpointError

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.original_inv_freq)$")
_FLOAT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model with its shape (fused experts; lm_head even when tied)."""
    h, d, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (v, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)}
        if cfg.is_sparse_layer(i):
            e, inter = cfg.num_experts, cfg.moe_intermediate_size
            shapes |= {p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_up_proj": (e, 2 * inter, h),
                       p + "mlp.experts.down_proj": (e, h, inter)}
        else:
            inter = cfg.intermediate_size
            shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)}
    return shapes


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise UnsupportedCheckpointError(f"shards listed in {index.name} are missing: {missing}")
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise UnsupportedCheckpointError(
            f"{path} holds PyTorch .bin weights; samebits reads safetensors: re-save with "
            "save_pretrained(safe_serialization=True)"
        )
    raise UnsupportedCheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from samebits.progress import maybe_progress

    for f in maybe_progress(files, "loading shards"):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def _listing(names, limit: int = 10) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_state_dict(path: str | Path, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config.json and the safetensors weights; validate names, shapes and dtypes."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    cfg = ModelConfig.from_pretrained(path)
    shapes = expected_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    unexpected = []
    for name, t in _iter_tensors(_weight_files(path)):
        if _IGNORED.search(name):
            continue
        if not t.is_floating_point() or t.dtype not in _FLOAT_DTYPES or name.endswith(("qweight", "scales", "qzeros")):
            raise UnsupportedCheckpointError(
                f"tensor {name} is {t.dtype}: quantised or integer weights are not supported; "
                "use the bf16 or fp32 checkpoint"
            )
        t = t.to(device=device, dtype=dtype) if dtype is not None else t.to(device)
        m = _PER_EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
            if len(experts[m.group(1)]) == 3 * cfg.num_experts:
                state |= _stack_experts(m.group(1), experts.pop(m.group(1)), cfg)
        elif name in shapes:
            state[name] = t
        else:
            unexpected.append(name)
    for prefix, parts in experts.items():
        have = {e for e, _ in parts}
        lost = [f"{prefix}.{e}.{k}_proj.weight" for e in range(cfg.num_experts) for k in ("gate", "up", "down")
                if (e, k) not in parts]
        if prefix + ".gate_up_proj" in shapes:
            raise UnsupportedCheckpointError(f"missing expert tensors: {_listing(lost)} (have experts {sorted(have)})")
        unexpected += [f"{prefix}.{e}.{k}_proj.weight" for e, k in parts]
    if cfg.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    _check(state, shapes, unexpected)
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) > 1:
        raise UnsupportedCheckpointError(
            f"checkpoint mixes dtypes {sorted(map(str, dtypes))}; pass dtype= to cast them to one"
        )
    return cfg, state


def _stack_experts(prefix: str, parts: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    e_range = range(cfg.num_experts)
    inter, h = cfg.moe_intermediate_size, cfg.hidden_size
    for (e, kind), t in parts.items():
        want = (h, inter) if kind == "down" else (inter, h)
        if tuple(t.shape) != want:
            raise UnsupportedCheckpointError(
                f"tensor {prefix}.{e}.{kind}_proj.weight has shape {tuple(t.shape)}, expected {want}"
            )
    gate_up = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]], dim=0) for e in e_range])
    down = torch.stack([parts[(e, "down")] for e in e_range])
    return {prefix + ".gate_up_proj": gate_up, prefix + ".down_proj": down}


def _check(state: dict, shapes: dict, unexpected: list[str]) -> None:
    if unexpected:
        raise UnsupportedCheckpointError(f"unexpected tensors in checkpoint: {_listing(unexpected)}")
    missing = [n for n in shapes if n not in state]
    if missing:
        raise UnsupportedCheckpointError(f"missing tensors in checkpoint: {_listing(missing)}")
    bad = [f"{n} (expected {shapes[n]}, got {tuple(t.shape)})" for n, t in state.items()
           if tuple(t.shape) != shapes[n]]
    if bad:
        raise UnsupportedCheckpointError(f"mis-shaped tensors: {_listing(bad)}")


def save_state_dict(cfg_dict: dict, state: dict[str, torch.Tensor], path: str | Path,
                    max_shard_bytes: int | None = None) -> Path:
    """Write config.json and safetensors (sharded with an index when max_shard_bytes is set)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    tensors = {n: t.detach().contiguous().cpu() for n, t in state.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    shards: list[dict] = [{}]
    size = 0
    for n, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
