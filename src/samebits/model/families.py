"""Which model family a checkpoint or a transformers model belongs to (`model/family.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from samebits.model.config_files import read_config_json
from samebits.model.family import ModelFamily
from samebits.model.qwen3_moe.family import Qwen3MoeFamily
from samebits.model.qwen3_omni.family import Qwen3OmniFamily

FAMILIES: tuple[type, ...] = (Qwen3OmniFamily, Qwen3MoeFamily)
DEFAULT = Qwen3MoeFamily  # a causal LM with plain positions; its loader refuses what it cannot run


def family_for(source) -> type[ModelFamily]:
    """The family of a checkpoint directory, a config.json dict or a transformers config.

    Unknown configs get the Qwen3-MoE family, whose loader names what it does not support."""
    config = _config_dict(source)
    return next((f for f in FAMILIES if f.matches(config)), DEFAULT)


def _config_dict(source) -> dict:
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, str | Path):
        return read_config_json(source)  # a missing file or bad JSON refused by name
    return source.to_dict()  # a transformers PretrainedConfig


def check_checkpoint_config(path: str | Path):
    """Validate a checkpoint's `config.json` and `generation_config.json` exactly as the engine
    does, before any work: the one check `LLM` and `trainer.load_hf_model` share.

    Returns the config its family validates (`family_for(path).read_config`: `ModelConfig` for
    Qwen3-MoE, `OmniConfig` for Qwen3-Omni); raises UnsupportedCheckpointError naming the file
    and field (a missing or unreadable file, bad JSON, a missing or impossible field, an
    unsupported model type, rope or quantisation).
    """
    return family_for(path).read_config(path)
