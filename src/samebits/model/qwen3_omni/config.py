"""The Qwen3-Omni thinker's shape, read from a full Omni or a thinker-only checkpoint.

transformers reads `config.json` (`AutoConfig`: `Qwen3OmniMoeConfig` or
`Qwen3OmniMoeThinkerConfig`) and `generation_config.json`; samebits validates on top. The
text decoder is a Qwen3-MoE decoder (`ModelConfig`, from the thinker's `text_config`); the
rest is what the engine needs to place multimodal features and compute M-RoPE positions.
The encoders are transformers' own modules, built from the thinker's `vision_config` /
`audio_config` as they stand.

Every Omni config is read through `OmniConfig.from_hf`, which first refuses a transformers
older than `OMNI_TRANSFORMERS` (`check_omni_transformers`): the engine's thinker names, its
audio lengths and the trainer's thinker modules follow transformers 5.21's thinker.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from samebits.model import config_files as _c
from samebits.model.qwen3_moe.config import (
    ModelConfig,
    UnsupportedCheckpointError,
    architectures,
    check_required,
)

OMNI_FULL = "Qwen3OmniMoeForConditionalGeneration"
OMNI_THINKER = "Qwen3OmniMoeThinkerForConditionalGeneration"
OMNI_ARCHITECTURES = (OMNI_FULL, OMNI_THINKER)
_MODEL_TYPES = {"qwen3_omni_moe": OMNI_FULL, "qwen3_omni_moe_thinker": OMNI_THINKER}
_TOKEN_FIELDS = ("image_token_id", "video_token_id", "audio_token_id", "vision_start_token_id")
_TOKEN_FIELDS += ("audio_start_token_id",)
# The oldest transformers the thinker runs on. Before it (seen: 5.10.4, 5.17.0, 5.20.2) the thinker
# holds its text model, `visual` and `audio_tower` at the top (5.21: `model.language_model`,
# `model.visual`, `model.audio_tower`), and 5.10.4's `_get_feat_extract_output_lengths` takes no
# `n_window` (docs/transformers-versions.md). `packaging` comes with transformers.
OMNI_TRANSFORMERS = "5.21"


def check_omni_transformers(version: str | None = None) -> None:
    """Refuse (UnsupportedCheckpointError) a transformers older than OMNI_TRANSFORMERS;
    `version`: the installed transformers' unless given."""
    from packaging.version import Version

    if version is None:
        import transformers

        version = transformers.__version__
    if Version(version) < Version(OMNI_TRANSFORMERS):
        raise UnsupportedCheckpointError(
            f"Qwen3-Omni needs transformers>={OMNI_TRANSFORMERS} (older releases lay out the thinker "
            f"differently); you have {version}; pip install 'transformers>={OMNI_TRANSFORMERS},<6' "
            "(Qwen3-MoE runs on 5.10.4 and newer)"
        )


@dataclass(frozen=True)
class OmniConfig:
    """Shape of a Qwen3-Omni thinker: the text decoder plus multimodal token ids (HF field
    names), validated on construction. `text.eos_token_id` follows ModelConfig's rule
    (generation_config.json's eos ids take precedence over the thinker text_config's)."""

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

    def __post_init__(self):
        section, head_dim = self.mrope_section, self.text.head_dim
        if (
            len(section) != 3
            or not all(_c.is_int(s) and s > 0 for s in section)
            or 2 * sum(section) != head_dim
        ):
            raise UnsupportedCheckpointError(
                f"text_config.rope_parameters.mrope_section {list(section)} must have 3 positive entries "
                f"summing to head_dim / 2 ({head_dim // 2})"
            )
        for name in _TOKEN_FIELDS:
            v = getattr(self, name)
            if not (_c.is_int(v) and 0 <= v < self.text.vocab_size):
                raise UnsupportedCheckpointError(
                    f"{name} is {v!r}; it must be a token id in [0, vocab_size={self.text.vocab_size})"
                )
        if not (_c.is_int(self.spatial_merge_size) and self.spatial_merge_size > 0):
            raise UnsupportedCheckpointError(
                f"vision_config.spatial_merge_size is {self.spatial_merge_size!r}; "
                "it must be a positive integer"
            )

    @property
    def placeholder_token_ids(self) -> tuple[int, int, int]:
        """Tokens the encoders' features replace; never sampled (see docs/omni.md)."""
        return (self.image_token_id, self.video_token_id, self.audio_token_id)

    def hf_thinker_config(self):
        """transformers' `Qwen3OmniMoeThinkerConfig` for this thinker."""
        from transformers import Qwen3OmniMoeThinkerConfig

        return Qwen3OmniMoeThinkerConfig.from_dict(self.thinker)

    @classmethod
    def from_hf(cls, hf, raw: dict, eos: tuple[int, ...] | None = None) -> OmniConfig:
        """The validated view of transformers' `Qwen3OmniMoeConfig` / `Qwen3OmniMoeThinkerConfig`
        (`raw`: the config.json dict it came from; `eos`: None for the text_config's). A
        transformers older than OMNI_TRANSFORMERS is refused first."""
        check_omni_transformers()
        arch = _MODEL_TYPES[raw["model_type"]]
        full = arch == OMNI_FULL
        thinker, raw_thinker = (hf.thinker_config, raw.get("thinker_config")) if full else (hf, raw)
        where = "thinker_config." if full else ""
        if not isinstance(raw_thinker, dict) or not isinstance(raw_thinker.get("text_config"), dict):
            raise UnsupportedCheckpointError(f"{where}text_config is missing; a Qwen3-Omni thinker needs one")
        for cfg, name in ((hf, ""), (thinker, where)):
            if getattr(cfg, "quantization_config", None):
                raise UnsupportedCheckpointError(f"{name}quantization_config: quantised checkpoints are not "
                                                 "supported; use the bf16 weights")  # fmt: skip
        text_hf = thinker.text_config
        with _prefixed(where + "text_config."):
            check_required(raw_thinker["text_config"])
            text = ModelConfig.from_hf(
                text_hf,
                _c.eos_ids(text_hf.eos_token_id) if eos is None else eos,
                architecture=arch,
                tie_word_embeddings=thinker.tie_word_embeddings,
                torch_dtype=_c.dtype_name(hf.dtype),
            )
        with _prefixed(where):
            return cls(
                text=text,
                architecture=arch,
                mrope_section=tuple((text_hf.rope_parameters or {}).get("mrope_section") or (24, 20, 20)),
                image_token_id=thinker.image_token_id,
                video_token_id=thinker.video_token_id,
                audio_token_id=thinker.audio_token_id,
                vision_start_token_id=getattr(
                    thinker, "vision_start_token_id", 151652
                ),  # transformers' default
                audio_start_token_id=thinker.audio_start_token_id,
                spatial_merge_size=thinker.vision_config.spatial_merge_size,
                thinker=thinker.to_dict(),
            )

    @classmethod
    def from_dict(cls, d: dict) -> OmniConfig:
        """From an in-memory full Omni or thinker `config.json` dict."""
        with _c.named("config dict"):
            _check_omni_type(d)
        hf = _c.hf_config(d, d["model_type"])
        with _c.named("config dict"):
            return cls.from_hf(hf, d)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> OmniConfig:
        """Read `path/config.json` and `path/generation_config.json` through transformers and validate."""
        raw = _c.read_config_json(path)
        file = Path(path) / "config.json"
        with _c.named(file):
            _check_omni_type(raw)
        hf = _c.auto_config(path)
        text_hf = (hf.thinker_config if raw["model_type"] == "qwen3_omni_moe" else hf).text_config
        eos = _c.generation_eos(path, text_hf.eos_token_id, text_hf.vocab_size)
        with _c.named(file):
            return cls.from_hf(hf, raw, eos)


def omni_model_type(d: dict) -> str | None:
    """'qwen3_omni_moe' / 'qwen3_omni_moe_thinker' when a config dict names Qwen3-Omni by its
    model_type or architectures, else None."""
    if d.get("model_type") in _MODEL_TYPES:
        return d["model_type"]
    types = {arch: mt for mt, arch in _MODEL_TYPES.items()}
    archs = d.get("architectures")
    return next((types[a] for a in archs if a in types), None) if isinstance(archs, list) else None


def omni_architecture(d: dict) -> str | None:
    """OMNI_FULL / OMNI_THINKER for a Qwen3-Omni config dict, else None."""
    model_type = omni_model_type(d)
    return None if model_type is None else _MODEL_TYPES[model_type]


def is_omni_checkpoint(path: str | Path) -> bool:
    """True when `path/config.json` describes a Qwen3-Omni model or its thinker (False when
    there is no config.json; unreadable JSON is refused by name)."""
    if not (Path(path) / "config.json").is_file():
        return False
    return omni_model_type(_c.read_config_json(path)) is not None


def _check_omni_type(d: dict) -> None:
    """model_type names the Omni layout and architectures, when listed, agree with it."""
    model_type, archs = d.get("model_type"), architectures(d)
    if model_type not in _MODEL_TYPES:
        want = omni_model_type(d) or "qwen3_omni_moe"
        raise UnsupportedCheckpointError(
            f"model_type {model_type!r} does not name a Qwen3-Omni config (architectures {archs}); "
            f'set "model_type": {want!r}'
        )
    if any(a != _MODEL_TYPES[model_type] for a in archs):
        raise UnsupportedCheckpointError(
            f"architectures {archs} do not match model_type {model_type!r} "
            f"(expected [{_MODEL_TYPES[model_type]!r}])"
        )


@contextlib.contextmanager
def _prefixed(prefix: str):
    """Field names inside the thinker read as `thinker_config.text_config.<field>`."""
    try:
        yield
    except UnsupportedCheckpointError as e:
        raise UnsupportedCheckpointError(f"{prefix}{e}") from None
