"""The Qwen3-MoE family (`Qwen3MoeForCausalLM`) as the engine and the trainer see it."""

from __future__ import annotations

import torch

from samebits.model.config_match import config_differences, refuse_other_shape
from samebits.model.family import build_model, text_positions
from samebits.model.qwen3_moe import loader
from samebits.model.qwen3_moe.config import ModelConfig
from samebits.model.qwen3_moe.model import Qwen3MoeForCausalLM
from samebits.requests import as_multimodal


class Qwen3MoeFamily:
    """The Qwen3-MoE family (`Qwen3MoeForCausalLM`): token prompts, positions [T], no extra
    step inputs; on the trainer side plain position ids. See `model/family.py`."""

    name = "qwen3_moe"
    never_sample: tuple[int, ...] = ()

    def __init__(self, config: ModelConfig, model: Qwen3MoeForCausalLM):
        self.config = config
        self.model = model

    @classmethod
    def matches(cls, config: dict) -> bool:
        return "Qwen3MoeForCausalLM" in (config.get("architectures") or ()) or (
            config.get("model_type") == "qwen3_moe"
        )

    @classmethod
    def read_config(cls, path) -> ModelConfig:
        return ModelConfig.from_pretrained(path)

    @classmethod
    def load(cls, path, *, dtype, device, weights=None) -> Qwen3MoeFamily:
        """From a checkpoint directory; `weights`: (HF name, tensor) pairs shared, not copied."""
        if weights is not None:
            config = ModelConfig.from_pretrained(path)
            state = loader.shared_state_dict(config, weights, dtype, device)
        else:
            config, state = loader.load_state_dict(path, dtype=dtype, device=device)
        return cls(config, build_model(lambda: Qwen3MoeForCausalLM(config), state, device))

    def checkpoint_names(self, path, where: str):
        """Refuse a checkpoint at `path` of another config shape; its tensor names are ours."""
        refuse_other_shape(config_differences(self.config, ModelConfig.from_pretrained(path)), path, where)
        return lambda disk_name: disk_name

    def prepare(self, i: int, prompt, ids: list[int]) -> None:
        if as_multimodal(prompt) is not None:
            raise ValueError(f"request {i}: a multimodal prompt needs a Qwen3-Omni checkpoint")
        return None

    def positions(self, spans) -> torch.Tensor:
        return text_positions(spans)  # [T]

    def step_inputs(self, spans) -> dict:
        return {}

    @staticmethod
    def trainer_prompts(sequences, prompt_lens, multimodal) -> list:
        if multimodal is not None:
            raise ValueError("multimodal inputs need the Qwen3-Omni thinker (trainer.load_hf_thinker)")
        return [None] * len(sequences)

    @staticmethod
    def trainer_inputs(model, sequences, prompts) -> tuple[torch.Tensor, dict]:
        """position_ids [1, N]: 0..n-1 per sequence (packed attention reads the boundaries)."""
        return torch.cat([torch.arange(len(s)) for s in sequences])[None], {}

    @staticmethod
    def trainer_decoder(model):
        return model
