"""What `LLM` needs for a Qwen3-Omni checkpoint: the loaded thinker, request checks, and each
request's multimodal state."""

from __future__ import annotations

from pathlib import Path

import torch

from samebits.engine.multimodal import MultimodalPrompt, MultimodalState, check_prompt, new_state
from samebits.model.omni import RopeIndex, build_thinker
from samebits.model.omni_loader import load_thinker_weights


class OmniFrontend:
    """The thinker of an Omni checkpoint, and the per-request multimodal bookkeeping."""

    def __init__(self, path: str | Path, dtype: torch.dtype, device: str):
        self.config, weights = load_thinker_weights(path, dtype=dtype)
        self.has_vision = weights.vision is not None
        self.has_audio = weights.audio is not None
        self.model = build_thinker(self.config, weights, device)
        self._rope_index = RopeIndex(self.config)

    @property
    def never_sample(self) -> tuple[int, ...]:
        """Placeholder tokens: transformers' thinker cannot recompute a response holding them."""
        return self.config.placeholder_token_ids

    def state(self, i: int, prompt: MultimodalPrompt | None, ids: list[int]) -> MultimodalState:
        """Request i's state (positions now, features at its first prefill); ValueError naming it."""
        mm = prompt if prompt is not None else MultimodalPrompt(ids)
        problem = check_prompt(mm, self.config, self.has_vision, self.has_audio)
        if problem:
            raise ValueError(f"request {i}: {problem}")
        try:
            return new_state(mm, self.config, self._rope_index)
        except Exception as e:  # noqa: BLE001 - transformers' position logic refused the prompt
            raise ValueError(f"request {i}: the thinker's get_rope_index failed on this prompt: {e}") from e
