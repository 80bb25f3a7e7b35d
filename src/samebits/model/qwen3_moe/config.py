"""The decoder's shape: transformers reads `config.json` and `generation_config.json`,
samebits validates what it can serve exactly on top and keeps a frozen view.

Every refusal is an `UnsupportedCheckpointError` raised before any weight is read, whose
message names the file and the field and says what to do. `check_checkpoint_config`
(`model/families.py`) is the one entry both the engine (`LLM`) and `trainer.load_hf_model`
use, so both refuse the same checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from samebits.model.config_files import (
    UnsupportedCheckpointError,
    auto_config,
    check_eos,
    dtype_name,
    eos_ids,
    generation_eos,
    hf_config,
    is_int,
    named,
    read_config_json,
)

__all__ = ["ModelConfig", "UnsupportedCheckpointError"]

QWEN3_MOE = "Qwen3MoeForCausalLM"
SUPPORTED_ARCHITECTURES = (QWEN3_MOE,)
# Fields without which the decoder's shape is a guess: transformers would fill its defaults
# (a 2048-wide, 24-layer model) and the weights would then not fit.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_SUPPORTED_TYPES = (
    "Qwen3-MoE (model_type 'qwen3_moe') and Qwen3-Omni ('qwen3_omni_moe', 'qwen3_omni_moe_thinker')"
)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen3-MoE decoder (HF field names), validated on construction.

    `eos_token_id` holds the ids a request stops at: those of `generation_config.json` when
    that file exists (it takes precedence over `config.json`'s, as in transformers'
    `generate`, which reads only the model's generation config), else `config.json`'s.
    """

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
    architecture: str = QWEN3_MOE
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        _validate(self)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Same rule as transformers' Qwen3MoeDecoderLayer."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(
        cls, hf, eos: tuple[int, ...], architecture: str = QWEN3_MOE, extra: dict | None = None, **over
    ) -> ModelConfig:
        """The validated view of a transformers text config (`Qwen3MoeConfig` or the Omni
        thinker's `Qwen3OmniMoeTextConfig`). Raises UnsupportedCheckpointError naming the field."""
        _check_supported(hf)
        rope = hf.rope_parameters or {}
        if "rope_theta" not in rope:
            raise UnsupportedCheckpointError("rope_parameters has no rope_theta; add it (e.g. 1000000.0)")
        fields = dict(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            moe_intermediate_size=hf.moe_intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads,
            head_dim=_head_dim(hf),
            num_experts=hf.num_experts,
            num_experts_per_tok=hf.num_experts_per_tok,
            norm_topk_prob=hf.norm_topk_prob,
            decoder_sparse_step=hf.decoder_sparse_step,
            mlp_only_layers=tuple(hf.mlp_only_layers or ()),
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope["rope_theta"],
            attention_bias=hf.attention_bias,
            tie_word_embeddings=getattr(hf, "tie_word_embeddings", False),  # the Omni thinker: over=
            max_position_embeddings=hf.max_position_embeddings,
            eos_token_id=eos,
            torch_dtype=dtype_name(hf.dtype),
            architecture=architecture,
            extra=extra or {},
        )
        return cls(**(fields | over))

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """From an in-memory `config.json` dict (model_type may be left out when
        `architectures` names Qwen3MoeForCausalLM). Errors name the field."""
        with named("config dict"):
            _check_model_type(d, default="qwen3_moe" if QWEN3_MOE in (d.get("architectures") or []) else None)
            check_required(d)
        hf = hf_config(d, d.get("model_type", "qwen3_moe"))
        with named("config dict"):
            return cls.from_hf(hf, eos_ids(hf.eos_token_id), extra=d)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json` and `path/generation_config.json` through transformers
        (`AutoConfig`, `GenerationConfig`) and validate them; see the class docstring for eos."""
        raw = read_config_json(path)
        file = Path(path) / "config.json"
        with named(file):
            _check_model_type(raw)
            check_required(raw)
        hf = auto_config(path)
        eos = generation_eos(path, hf.eos_token_id, hf.vocab_size)
        with named(file):
            return cls.from_hf(hf, eos, extra=raw)


# -- validation ----------------------------------------------------------------------------


def _check_model_type(d: dict, default: str | None = None) -> None:
    """A Qwen3-MoE causal LM: model_type 'qwen3_moe' and, when listed, Qwen3MoeForCausalLM."""
    archs = architectures(d)
    model_type = d.get("model_type", default)
    if model_type is None:
        raise UnsupportedCheckpointError(
            'model_type is missing; add "model_type": "qwen3_moe" (transformers needs it too)'
        )
    if model_type != "qwen3_moe" or any(a not in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedCheckpointError(
            f"model_type {model_type!r} / architectures {archs} is not supported; "
            f"samebits runs {_SUPPORTED_TYPES}"
        )


def architectures(d: dict) -> list[str]:
    """config.json's `architectures` (a list of class names; absent or null: [])."""
    archs = d.get("architectures") or []
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise UnsupportedCheckpointError(f"architectures is {archs!r}; it must be a list of class names")
    return archs


def check_required(d: dict) -> None:
    """Refuse a config that leaves out a field transformers would silently default, or whose
    `head_dim` (not a declared transformers field, so not type-checked there) is not an int."""
    missing = [f for f in REQUIRED_FIELDS if f not in d]
    if missing:
        raise UnsupportedCheckpointError(
            f"{missing[0]} is missing (missing: {', '.join(missing)}); add it from the model's config"
        )
    if "head_dim" in d and not is_int(d["head_dim"]):
        raise UnsupportedCheckpointError(
            f"head_dim is {d['head_dim']!r}; it must be a positive integer or absent"
        )


def _check_supported(hf) -> None:
    """What transformers would run but samebits does not (yet) compute exactly."""
    quant = getattr(hf, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise UnsupportedCheckpointError(
            f"quantization_config: quantised checkpoints are not supported (quant_method={method!r}); "
            "use the bf16 or fp32 weights"
        )
    rope = hf.rope_parameters or {}
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise UnsupportedCheckpointError(
            f"rope_parameters.rope_type {kind!r} is not supported yet; only 'default' rotary embeddings "
            "(remove rope_scaling / set rope_type 'default' only if the model was trained so)"
        )
    if getattr(hf, "use_sliding_window", False):
        raise UnsupportedCheckpointError("use_sliding_window=true is not supported; set it to false")
    if hf.hidden_act != "silu":
        raise UnsupportedCheckpointError(f"hidden_act {hf.hidden_act!r} is not supported; only 'silu'")


def _head_dim(hf) -> int:
    """transformers' attention uses `head_dim` when present, else hidden_size // heads."""
    if not hasattr(hf, "head_dim"):
        if not is_int(hf.num_attention_heads) or hf.num_attention_heads <= 0:
            return 0  # refused by _validate, naming num_attention_heads
        return hf.hidden_size // hf.num_attention_heads
    if not is_int(hf.head_dim):
        raise UnsupportedCheckpointError(
            f"head_dim is {hf.head_dim!r}; it must be a positive integer or absent"
        )
    return hf.head_dim


def _validate(c: ModelConfig) -> None:
    positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
    positive += ["num_key_value_heads", "head_dim", "max_position_embeddings", "decoder_sparse_step"]
    for name in positive + ["intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"]:
        if not is_int(getattr(c, name)):
            raise UnsupportedCheckpointError(f"{name} is {getattr(c, name)!r}; it must be an integer")
    for name in positive:
        if getattr(c, name) <= 0:
            raise UnsupportedCheckpointError(f"{name} is {getattr(c, name)}; it must be a positive integer")
    if c.num_attention_heads % c.num_key_value_heads:
        raise UnsupportedCheckpointError(
            f"num_attention_heads ({c.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({c.num_key_value_heads})"
        )
    _validate_experts(c)
    for name in ("rms_norm_eps", "rope_theta"):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise UnsupportedCheckpointError(f"{name} is {v!r}; it must be a finite number > 0")
    if not all(is_int(i) for i in c.mlp_only_layers):
        raise UnsupportedCheckpointError(f"mlp_only_layers {list(c.mlp_only_layers)} must list layer indices")
    check_eos(c.eos_token_id, c.vocab_size)


def _validate_experts(c: ModelConfig) -> None:
    if c.num_experts < 0:
        raise UnsupportedCheckpointError(f"num_experts is {c.num_experts}; it must be >= 0 (0: no MoE layer)")
    sparse = [c.is_sparse_layer(i) for i in range(c.num_hidden_layers)]
    if any(sparse):
        if not 1 <= c.num_experts_per_tok <= c.num_experts:
            raise UnsupportedCheckpointError(
                f"num_experts_per_tok is {c.num_experts_per_tok}; "
                f"it must be in [1, num_experts={c.num_experts}]"
            )
        if c.moe_intermediate_size <= 0:
            raise UnsupportedCheckpointError(
                f"moe_intermediate_size is {c.moe_intermediate_size}; it must be > 0"
            )
    if not all(sparse) and c.intermediate_size <= 0:
        raise UnsupportedCheckpointError(
            f"intermediate_size is {c.intermediate_size}; it must be > 0 (the model has dense MLP layers)"
        )
