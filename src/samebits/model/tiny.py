"""The built-in tiny Qwen3-MoE: random weights from a fixed seed, saved by transformers itself."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

TINY_SHAPE: dict = dict(
    vocab_size=384, hidden_size=96, num_hidden_layers=3, mlp_only_layers=[1],
    intermediate_size=160, moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=24, norm_topk_prob=True,
    tie_word_embeddings=False, max_position_embeddings=2048, rope_theta=10000.0,
    rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=0, pad_token_id=None,
)


def _randomise(model, seed: int) -> None:
    """Weights large enough that the next-token distribution is far from flat."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def build_tiny_checkpoint(path: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                          per_expert_layout: bool = False, **overrides) -> Path:
    """Build a random Qwen3MoeForCausalLM of TINY_SHAPE (+ overrides) and save it at path."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**(TINY_SHAPE | overrides))
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    _randomise(model, seed)
    model = model.to(dtype)
    path = Path(path)
    if per_expert_layout:
        from samebits.model.loader import save_state_dict

        cfg_dict = json.loads(cfg.to_json_string())
        cfg_dict["architectures"] = ["Qwen3MoeForCausalLM"]
        cfg_dict["dtype"] = str(dtype).removeprefix("torch.")
        save_state_dict(cfg_dict, to_per_expert(model.state_dict()), path)
    else:
        model.save_pretrained(path)
    return path


def to_per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rewrite fused expert tensors in the legacy per-expert layout."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def tiny_checkpoint_cache(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The tiny checkpoint in a cache folder ($SAMEBITS_CACHE or ~/.cache/samebits), built once."""
    import transformers

    key = json.dumps([TINY_SHAPE, seed, str(dtype), transformers.__version__], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(os.environ.get("SAMEBITS_CACHE", Path.home() / ".cache" / "samebits"))
    final = root / f"tiny-{digest}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
    try:
        build_tiny_checkpoint(tmp, seed=seed, dtype=dtype)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
