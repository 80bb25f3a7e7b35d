"""A model family: the one thing that varies between the models samebits runs.

`LLM`, the runner, the CUDA graphs and `trainer.token_logprobs` call only this protocol;
none of them knows which family it runs. The families are `Qwen3MoeFamily`
(`model/qwen3_moe/family.py`) and `Qwen3OmniFamily` (`model/qwen3_omni/family.py`); `model/families.py`
picks one from a checkpoint's config.

Engine side (one family object per loaded model):

    read_config(path)          the checkpoint's validated config (the family's own class);
                               UnsupportedCheckpointError naming the file and field
    load(path, dtype, device, weights)  -> the family, holding `model` and `config`
    prepare(i, prompt, ids)    request i's per-request state (None for text models);
                               ValueError "request {i}: ..." naming the field
    positions(spans)           rotary positions of a step: [T] long, or [3, T] T/H/W rows
    step_inputs(spans)         extra `model(...)` keywords of a step; {} for a plain token step
                               (every decode step runs as a CUDA graph only when {} )
    checkpoint_names(path, where)  for update_weights_from_disk: refuse a checkpoint of another
                               config shape; -> its tensor name -> the model's (None: skipped)

Trainer side (on the transformers model):

    trainer_prompts(sequences, prompt_lens, multimodal)  per-sequence prompts, checked
    trainer_inputs(model, sequences, prompts)  position_ids and extra forward keywords of
                                               sequences packed into one row
    trainer_decoder(model)     the module whose rotary `inv_freq` must be the CPU formula's

The model a family loads is called as `model(input_ids [T], positions, meta, kv_caches,
**step_inputs) -> hidden [T, H]` and `model.compute_logits(hidden [N, H]) -> [N, V]`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
from torch import nn

from samebits.model.qwen3_moe.config import ModelConfig


class Span(NamedTuple):
    """One request's tokens in a step: indices start..end-1 of its sequence."""

    state: Any  # what the family's `prepare` returned for the request
    start: int
    end: int


class ModelFamily(Protocol):
    name: ClassVar[str]
    config: ModelConfig  # the text decoder: vocabulary, eos, layers, KV heads, limits
    model: nn.Module
    never_sample: tuple[int, ...]  # token ids banned from sampling (placeholders)

    @classmethod
    def matches(cls, config: dict) -> bool: ...

    @classmethod
    def read_config(cls, path: Path) -> Any: ...

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        dtype: torch.dtype,
        device: str,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> ModelFamily: ...

    def prepare(self, i: int, prompt: Any, ids: list[int]) -> Any: ...

    def positions(self, spans: Sequence[Span]) -> torch.Tensor: ...

    def step_inputs(self, spans: Sequence[Span]) -> dict[str, Any]: ...

    def checkpoint_names(self, path: Path, where: str) -> Callable[[str], str | None]: ...

    @staticmethod
    def trainer_prompts(sequences, prompt_lens, multimodal) -> list: ...

    @staticmethod
    def trainer_inputs(model, sequences, prompts) -> tuple[torch.Tensor, dict[str, Any]]: ...

    @staticmethod
    def trainer_decoder(model) -> nn.Module: ...


def text_positions(spans: Sequence[Span]) -> torch.Tensor:
    """[T] long: each token's index in its sequence."""
    return torch.tensor([p for s in spans for p in range(s.start, s.end)], dtype=torch.long)


def build_model(make: Callable[[], nn.Module], state: dict[str, torch.Tensor], device) -> nn.Module:
    """`make()` built on meta, its parameters set to the tensors of `state` (assigned, not
    copied: shared weights stay shared), buffers computed by `model.finish_load()`, moved to
    `device`, frozen, in eval mode. The names in `state` are checked by the loader beforehand."""
    with torch.device("meta"):
        model = make()
    model.load_state_dict(state, strict=False, assign=True)
    for module in model.modules():  # empty CPU buffers; finish_load fills the ones that matter
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype)
    model.finish_load()
    model = model.to(device)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise RuntimeError(f"parameters not loaded: {leftover[:10]}")
    model.requires_grad_(False)
    return model.eval()
