"""The Qwen3-Omni family (`Qwen3OmniMoeThinkerForConditionalGeneration`): what the protocol
in `model/family.py` means for the thinker.

- load: a full Omni or a thinker-only checkpoint, or shared weights under the thinker's
  transformers names (a colocated trainer's `named_parameters()`).
- prepare: a prompt (token ids, str, `MultimodalPrompt` or processor dict) is checked against
  the checkpoint's encoders; its state holds its M-RoPE positions (`model/qwen3_omni/inputs.py`).
- positions: [3, T] float32 T/H/W rows; decode continues at `index + rope_delta`.
- step_inputs: `{"multimodal": MultimodalRows}` when the step covers placeholder rows (the
  encoders run at the first such step, under the step's numerics profile); {} otherwise, so
  every decode step is a plain token step and runs as a CUDA graph.
- trainer: 4-row position ids `[text; T; H; W]` (the text row 0..n-1 per sequence is what
  packed attention reads its boundaries from) and the prompts' processor tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from samebits.model.config_match import config_differences, refuse_other_shape
from samebits.model.family import build_model
from samebits.model.host_copy import to_device
from samebits.model.qwen3_omni.config import OmniConfig, check_omni_transformers, omni_architecture
from samebits.model.qwen3_omni.inputs import MultimodalState, check_prompt, encode, new_state
from samebits.model.qwen3_omni.loader import (
    ThinkerWeights,
    canonical_name,
    load_thinker_weights,
    shared_thinker_weights,
)
from samebits.model.qwen3_omni.model import MultimodalRows, Qwen3OmniThinker, RopeIndex
from samebits.requests import MultimodalPrompt, as_multimodal

_OMNI_FIELDS = (  # the thinker's fields beside the text decoder's that its weights are trained for
    "mrope_section",
    "image_token_id",
    "video_token_id",
    "audio_token_id",
    "vision_start_token_id",
    "audio_start_token_id",
    "spatial_merge_size",
)


class Qwen3OmniFamily:
    """The Qwen3-Omni thinker: multimodal prompts, M-RoPE positions [3, T], encoder features."""

    name = "qwen3_omni"

    def __init__(self, omni: OmniConfig, model: Qwen3OmniThinker, weights: ThinkerWeights, device):
        self.omni = omni
        self.config = omni.text
        self.model = model
        self.device = torch.device(device)
        self.has_vision = weights.vision is not None
        self.has_audio = weights.audio is not None
        self.never_sample = omni.placeholder_token_ids  # the trainer cannot recompute a response with one
        self._rope_index = RopeIndex(omni)

    @classmethod
    def matches(cls, config: dict) -> bool:
        return omni_architecture(config) is not None

    @classmethod
    def read_config(cls, path) -> OmniConfig:
        return OmniConfig.from_pretrained(path)  # the whole Omni config; `config` is its `.text`

    @classmethod
    def load(cls, path, *, dtype, device, weights=None) -> Qwen3OmniFamily:
        """From a checkpoint directory; `weights`: (thinker name, tensor) pairs shared, not copied."""
        if weights is not None:
            omni = OmniConfig.from_pretrained(path)
            parts = shared_thinker_weights(omni, weights, dtype, device)
        else:
            omni, parts = load_thinker_weights(path, dtype=dtype)
        state = {_thinker_name(n): t for n, t in parts.text.items()}
        for prefix, part in (("model.visual.", parts.vision), ("model.audio_tower.", parts.audio)):
            state |= {prefix + n: t for n, t in (part or {}).items()}
        has_vision, has_audio = parts.vision is not None, parts.audio is not None
        model = build_model(lambda: Qwen3OmniThinker(omni, has_vision, has_audio), state, device)
        return cls(omni, model, parts, device)

    def checkpoint_names(self, path, where: str):
        """Refuse a checkpoint at `path` of another thinker shape (a full Omni checkpoint or a
        thinker-only one of this model are both fine); -> its tensor name -> thinker name
        (None for talker/code2wav tensors, which are skipped)."""
        new = OmniConfig.from_pretrained(path)
        diffs = config_differences(self.config, new.text)
        diffs += [(f, getattr(self.omni, f), getattr(new, f)) for f in _OMNI_FIELDS]
        refuse_other_shape([d for d in diffs if d[1] != d[2]], path, where)
        return lambda disk_name: canonical_name(disk_name, new.architecture)

    # -- engine ------------------------------------------------------------------------------

    def prepare(self, i: int, prompt, ids: list[int]) -> MultimodalState:
        """Request i's state (positions now, features at its first step over them)."""
        mm = as_multimodal(prompt)
        mm = MultimodalPrompt(ids) if mm is None else dataclasses.replace(mm, prompt_token_ids=ids)
        problem = check_prompt(mm, self.omni, self.has_vision, self.has_audio)
        if problem:
            raise ValueError(f"request {i}: {problem}")
        try:
            return new_state(mm, self.omni, self._rope_index)
        except Exception as e:  # noqa: BLE001 - transformers' position logic refused the prompt
            raise ValueError(f"request {i}: the thinker's get_rope_index failed on this prompt: {e}") from e

    def positions(self, spans) -> torch.Tensor:
        """[3, T] float32 T/H/W positions (transformers' dtype: video times can be fractional)."""
        return torch.cat([s.state.positions_for(s.start, s.end) for s in spans], dim=1)

    def step_inputs(self, spans) -> dict:
        """The encoder features of the placeholder rows this step covers, or {}."""
        if not any(s.state.has_features_in(s.start, s.end) for s in spans):
            return {}
        rows, embeds, visual, deep = [], [], [], []
        row = 0
        for state, start, end in spans:
            if state.needs_encoding:
                encode(state, self.model, self.omni)
            # (host index tensors; the device gathers by index: a boolean index on the device
            # would wait for it, and this step may be built while the one before runs)
            in_span = ((state.feature_index >= start) & (state.feature_index < end)).nonzero()[:, 0]
            if in_span.numel():
                rows.append(state.feature_index[in_span] - start + row)
                embeds.append(state.embeds.index_select(0, to_device(in_span, state.embeds.device)))
            vis = ((state.visual_index >= start) & (state.visual_index < end)).nonzero()[:, 0]
            if vis.numel():
                visual.append(state.visual_index[vis] - start + row)
                deep.append([level.index_select(0, to_device(vis, level.device)) for level in state.deepstack])
            row += end - start
        return {"multimodal": self._rows(row, rows, embeds, visual, deep)}

    def _rows(self, total, rows, embeds, visual, deep) -> MultimodalRows:
        dev = self.device
        mask = torch.zeros(total, dtype=torch.bool)
        if visual:
            mask[torch.cat(visual)] = True
        levels = tuple(torch.cat(parts).to(dev) for parts in zip(*deep, strict=True)) if deep else ()
        return MultimodalRows(
            rows=to_device(torch.cat(rows), dev),
            embeds=torch.cat(embeds).to(dev),
            visual_mask=to_device(mask, dev),
            deepstack=levels,
        )

    # -- trainer (transformers' thinker) -----------------------------------------------------

    @staticmethod
    def trainer_prompts(sequences, prompt_lens, multimodal) -> list[MultimodalPrompt]:
        """multimodal[i]: sequence i's prompt as given to `LLM.generate` (None: text only).
        The trainer's first call on a thinker it did not load (`token_logprobs` on a user's
        model): a transformers older than OMNI_TRANSFORMERS is refused here, not as an
        AttributeError of its other thinker layout."""
        check_omni_transformers()
        prompts = []
        for i, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
            mm = as_multimodal(multimodal[i]) if multimodal is not None and multimodal[i] is not None else None
            mm = mm or MultimodalPrompt(list(seq[:p]))
            n = len(mm.prompt_token_ids)
            if list(seq[:n]) != list(mm.prompt_token_ids) or p != n:
                raise ValueError(f"sequence {i}: does not start with its multimodal prompt's token ids")
            prompts.append(mm)
        return prompts

    @staticmethod
    def trainer_inputs(model, sequences, prompts) -> tuple[torch.Tensor, dict]:
        """position_ids [4, 1, N] and the prompts' processor tensors, concatenated in order."""
        device = next(model.parameters()).device
        pos = torch.cat([_trainer_positions(model, s, mm) for s, mm in zip(sequences, prompts, strict=True)], 1)
        return pos[:, None], _packed_inputs(prompts, device)

    @staticmethod
    def trainer_decoder(model):
        return model.model.language_model


def _thinker_name(text_name: str) -> str:
    """Qwen3-MoE text name -> thinker name (`model.layers.0...` -> `model.language_model.layers.0...`)."""
    if text_name == "lm_head.weight":
        return text_name
    return "model.language_model." + text_name.removeprefix("model.")


def _trainer_positions(model, seq, mm: MultimodalPrompt) -> torch.Tensor:
    """[4, n] positions of prompt + response: text row, then the thinker's T/H/W rows."""
    p, n = len(mm.prompt_token_ids), len(seq)
    ids = torch.tensor(mm.prompt_token_ids, dtype=torch.long)[None]
    seqlens = None if mm.feature_attention_mask is None else mm.feature_attention_mask.sum(-1)
    pos, delta = model.get_rope_index(
        ids,
        image_grid_thw=mm.image_grid_thw,
        video_grid_thw=mm.video_grid_thw,
        attention_mask=torch.ones_like(ids),
        use_audio_in_video=False,
        audio_seqlens=seqlens,
        second_per_grids=mm.video_second_per_grid,
    )
    decode = (torch.arange(p, n) + delta.reshape(-1)[0]).view(1, -1).expand(3, -1)  # as generate continues
    thw = torch.cat([pos[:, 0], decode], dim=1)
    return torch.cat([torch.arange(n, dtype=thw.dtype)[None], thw], dim=0)


def _packed_inputs(prompts: list[MultimodalPrompt], device) -> dict:
    """The processor tensors of several prompts as one forward's: concatenated in order, audio
    features padded to the longest audio."""
    out = {}
    for key in (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "video_second_per_grid",
    ):
        parts = [getattr(mm, key) for mm in prompts if getattr(mm, key) is not None]
        if parts:
            out[key] = torch.cat(parts).to(device)
    audios = [mm for mm in prompts if mm.input_features is not None]
    if audios:
        frames = max(mm.input_features.shape[2] for mm in audios)
        pad = lambda t: torch.nn.functional.pad(t, (0, frames - t.shape[-1]))  # noqa: E731
        out["input_features"] = torch.cat([pad(mm.input_features) for mm in audios]).to(device)
        out["feature_attention_mask"] = torch.cat([pad(mm.feature_attention_mask) for mm in audios]).to(device)
    return out
