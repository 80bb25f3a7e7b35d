"""Prompts: token ids (or text), or token ids with a processor's multimodal tensors.

A multimodal prompt is one conversation: token ids with the processor's placeholders
(`<|vision_start|><|image_pad|>*n<|vision_end|>`, ... `<|audio_start|><|audio_pad|>*n<|audio_end|>`)
plus the processor's tensors, under the processor's key names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

_TENSOR_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "video_second_per_grid",
    "input_features",
    "feature_attention_mask",
)


@dataclass
class MultimodalPrompt:
    """Token ids plus the processor's tensors for one conversation (HF processor key names).

    pixel_values [patches, C*tp*p*p] with image_grid_thw [images, 3]; pixel_values_videos with
    video_grid_thw [videos, 3] and video_second_per_grid [videos]; input_features
    [audios, mel, frames] (padded) with feature_attention_mask [audios, frames].
    """

    prompt_token_ids: list[int]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None
    input_features: torch.Tensor | None = None
    feature_attention_mask: torch.Tensor | None = None

    @classmethod
    def from_processor(cls, inputs: Mapping) -> MultimodalPrompt:
        """From a processor's output for one conversation (`input_ids` [1, S] or [S]; `attention_mask`
        must be all ones); unknown keys are refused so nothing is silently dropped."""
        extra = set(inputs) - {"input_ids", "prompt_token_ids", "attention_mask", *_TENSOR_KEYS}
        if extra:
            raise ValueError(f"unknown multimodal prompt key(s) {sorted(extra)}; expected {list(_TENSOR_KEYS)}")
        ids = inputs.get("input_ids", inputs.get("prompt_token_ids"))
        if ids is None:
            raise ValueError("a multimodal prompt needs input_ids")
        ids = torch.as_tensor(ids)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError("attention_mask has padding: pass one unpadded conversation per prompt")
        kwargs = {k: _tensor(inputs[k]) for k in _TENSOR_KEYS if inputs.get(k) is not None}
        return cls(prompt_token_ids=ids.tolist(), **kwargs)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that are set, by HF forward keyword."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name in _TENSOR_KEYS and getattr(self, f.name) is not None
        }


def _tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def as_multimodal(prompt) -> MultimodalPrompt | None:
    """A MultimodalPrompt for a dict / MultimodalPrompt prompt; None for plain prompts."""
    if isinstance(prompt, MultimodalPrompt):
        return prompt
    if isinstance(prompt, Mapping):
        return MultimodalPrompt.from_processor(prompt)
    return None
