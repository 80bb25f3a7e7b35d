"""The decoder's shape, read from a HF `config.json` and validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


class UnsupportedCheckpointError(ValueError):
    """The checkpoint is not one samebits can run; the message says why and what to do."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen3-MoE decoder (HF field names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    architecture: str = "Qwen3MoeForCausalLM"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Same rule as transformers' Qwen3MoeDecoderLayer."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else d.get("model_type", "?")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedCheckpointError(
                f"architecture {arch!r} is not supported; samebits runs {SUPPORTED_ARCHITECTURES}"
            )
        if d.get("quantization_config"):
            method = d["quantization_config"].get("quant_method", "?")
            raise UnsupportedCheckpointError(
                f"quantised checkpoints are not supported (quant_method={method!r}); "
                "use the bf16 or fp32 weights"
            )
        _check_rope(d)
        if d.get("use_sliding_window"):
            raise UnsupportedCheckpointError(
                "use_sliding_window=true is not supported; set it to false in config.json"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedCheckpointError(f"hidden_act {act!r} is not supported; only 'silu'")
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads", 4)  # transformers' Qwen3MoeConfig defaults
        if heads % kv_heads:
            raise UnsupportedCheckpointError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        eos = d.get("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
        rope = d.get("rope_parameters") or {}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 0),
            moe_intermediate_size=d.get("moe_intermediate_size", 0),
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            num_experts=d.get("num_experts", d.get("num_local_experts", 0)) or 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            eos_token_id=eos,
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "bfloat16"),
            architecture=arch,
            extra=d,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"no config.json in {path}: pass a HF checkpoint directory")
        return cls.from_dict(json.loads(cfg.read_text()))


def _check_rope(d: dict) -> None:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UnsupportedCheckpointError(
            f"rope_type {kind!r} is not supported yet; only 'default' rotary embeddings"
        )
