"""The Qwen3-Omni thinker's shape, read from a full Omni or a thinker-only `config.json`.

The text decoder is a Qwen3-MoE decoder (`ModelConfig`, from the thinker's
`text_config`); the rest is what the engine needs to place multimodal features
and compute M-RoPE positions. The encoders are transformers' own modules, built
from the thinker's `vision_config` / `audio_config` as they stand.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from samebits.model.config import ModelConfig, UnsupportedCheckpointError

OMNI_FULL = "Qwen3OmniMoeForConditionalGeneration"
OMNI_THINKER = "Qwen3OmniMoeThinkerForConditionalGeneration"
OMNI_ARCHITECTURES = (OMNI_FULL, OMNI_THINKER)
_MODEL_TYPES = {"qwen3_omni_moe": OMNI_FULL, "qwen3_omni_moe_thinker": OMNI_THINKER}


@dataclass(frozen=True)
class OmniConfig:
    """Shape of a Qwen3-Omni thinker: the text decoder plus multimodal token ids (HF field names)."""

    text: ModelConfig
    architecture: str  # OMNI_FULL (weights under `thinker.`) or OMNI_THINKER
    mrope_section: tuple[int, ...]
    image_token_id: int
    video_token_id: int
    audio_token_id: int
    vision_start_token_id: int
    audio_start_token_id: int
    spatial_merge_size: int
    thinker: dict = field(compare=False, repr=False)  # the thinker config dict, for transformers

    @property
    def placeholder_token_ids(self) -> tuple[int, int, int]:
        """Tokens the encoders' features replace; never sampled (see docs/omni.md)."""
        return (self.image_token_id, self.video_token_id, self.audio_token_id)

    def hf_thinker_config(self):
        """transformers' `Qwen3OmniMoeThinkerConfig` for this thinker."""
        from transformers import Qwen3OmniMoeThinkerConfig

        return Qwen3OmniMoeThinkerConfig.from_dict(self.thinker)

    @classmethod
    def from_dict(cls, d: dict) -> OmniConfig:
        arch = omni_architecture(d)
        if arch is None:
            raise UnsupportedCheckpointError(
                "not a Qwen3-Omni config: architectures names neither " + str(OMNI_ARCHITECTURES)
            )
        for cfg in (d, d.get("thinker_config") or {}):
            if cfg.get("quantization_config"):
                method = cfg["quantization_config"].get("quant_method", "?")
                raise UnsupportedCheckpointError(
                    f"quantised checkpoints are not supported (quant_method={method!r}); use the bf16 weights"
                )
        thinker = d["thinker_config"] if arch == OMNI_FULL else d
        text = dict(thinker.get("text_config") or {})
        if not text:
            raise UnsupportedCheckpointError("the thinker config has no text_config")
        text["tie_word_embeddings"] = bool(thinker.get("tie_word_embeddings", False))
        # ModelConfig validates the decoder fields; the architecture is the thinker's, not Qwen3-MoE's
        text_cfg = ModelConfig.from_dict(text | {"architectures": ["Qwen3MoeForCausalLM"]})
        text_cfg = dataclasses.replace(text_cfg, architecture=arch)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        section = tuple(rope.get("mrope_section") or (24, 20, 20))  # transformers' default
        if len(section) != 3 or 2 * sum(section) != text_cfg.head_dim:
            raise UnsupportedCheckpointError(
                f"mrope_section {list(section)} must have 3 entries summing to head_dim / 2 "
                f"({text_cfg.head_dim // 2})"
            )
        vision = thinker.get("vision_config") or {}
        return cls(
            text=text_cfg,
            architecture=arch,
            mrope_section=section,
            image_token_id=thinker.get("image_token_id", 151655),
            video_token_id=thinker.get("video_token_id", 151656),
            audio_token_id=thinker.get("audio_token_id", 151646),
            vision_start_token_id=thinker.get("vision_start_token_id", 151652),
            audio_start_token_id=thinker.get("audio_start_token_id", 151647),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            thinker=thinker,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> OmniConfig:
        return cls.from_dict(_read_config(path))


def omni_architecture(d: dict) -> str | None:
    """OMNI_FULL / OMNI_THINKER for a Qwen3-Omni config dict, else None."""
    archs = d.get("architectures") or []
    for arch in archs:
        if arch in OMNI_ARCHITECTURES:
            return arch
    return None if archs else _MODEL_TYPES.get(d.get("model_type", ""))


def is_omni_checkpoint(path: str | Path) -> bool:
    """True when `path/config.json` describes a Qwen3-Omni model or its thinker."""
    cfg = Path(path) / "config.json"
    return cfg.is_file() and omni_architecture(json.loads(cfg.read_text())) is not None


def _read_config(path: str | Path) -> dict:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"no config.json in {path}: pass a HF checkpoint directory")
    return json.loads(cfg.read_text())
