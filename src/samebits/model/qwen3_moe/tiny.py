"""The built-in tiny Qwen3-MoE: random weights from a fixed seed, saved by transformers itself."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

TINY_SHAPE: dict = dict(
    vocab_size=384,
    hidden_size=96,
    num_hidden_layers=3,
    mlp_only_layers=[1],  # layer 1 dense, layers 0 and 2 sparse
    intermediate_size=160,
    moe_intermediate_size=48,
    num_experts=6,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    eos_token_id=1,
    bos_token_id=0,
    pad_token_id=None,
)

_CACHE_FORMAT = 2  # bump when what build_tiny_checkpoint writes changes


def build_tiny_model(seed: int = 0, dtype: torch.dtype = torch.bfloat16, **overrides):
    """A `Qwen3MoeForCausalLM` of TINY_SHAPE (+ overrides, Qwen3MoeConfig kwargs) in `dtype`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**(TINY_SHAPE | overrides)))
    _randomise(model, seed)
    return model.to(dtype).eval()


def _randomise(model, seed: int) -> None:
    """Weights larger than HF's init (std 0.02) so the next-token distribution is far from flat."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)


def build_tiny_checkpoint(
    path: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    per_expert_layout: bool = False,
    max_shard_size: str | int | None = None,
    **overrides,
) -> Path:
    """Build `build_tiny_model(seed, dtype, **overrides)` and save it at `path` with
    transformers' own `save_pretrained`.

    Experts are written fused (`mlp.experts.gate_up_proj`), or with `per_expert_layout`
    in the legacy per-expert layout, which is transformers 5.x's default on save.
    `max_shard_size` (e.g. "50KB") forces shards with an index.
    """
    model = build_tiny_model(seed, dtype, **overrides)
    path = Path(path)
    shard = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, save_original_format=per_expert_layout, **shard)
    sparse = any(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    if sparse and _written_per_expert(path) != per_expert_layout:
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__} did not write the "
            f"{'per-expert' if per_expert_layout else 'fused'} experts layout in {path}"
        )
    return path


def _written_per_expert(path: Path) -> bool:
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            if any(".mlp.experts.0." in n for n in fh.keys()):
                return True
    return False


def to_per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rewrite fused expert tensors in the legacy per-expert layout (other tensors kept)."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> E x ([I, H], [I, H])
            prefix = name.removesuffix("gate_up_proj")
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I] -> E x [H, I]
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def tiny_checkpoint_cache(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The tiny checkpoint in a cache folder ($SAMEBITS_CACHE or ~/.cache/samebits), built once.

    Built in a temporary folder beside it and renamed into place, so a folder under its
    final name is complete; concurrent callers may both build, one rename wins.
    """
    import transformers

    key = json.dumps([TINY_SHAPE, seed, str(dtype), transformers.__version__, _CACHE_FORMAT], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(os.environ.get("SAMEBITS_CACHE") or Path.home() / ".cache" / "samebits")
    final = root / f"tiny-{digest}"
    if _complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    if final.exists():  # damaged by hand: move it aside before rebuilding
        shutil.rmtree(final.rename(tempfile.mkdtemp(dir=root, prefix=".broken-")))
    return build_atomically(final, lambda tmp: build_tiny_checkpoint(tmp, seed=seed, dtype=dtype))


def build_atomically(final: Path, build) -> Path:
    """`build(tmp)` into a fresh sibling folder, then renamed to `final` in one step, so
    readers never see a half-built cache entry; a concurrent builder's result wins."""
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".building-"))
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()
