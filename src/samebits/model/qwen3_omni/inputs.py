"""The Qwen3-Omni family's per-request state: how a multimodal prompt is checked, its M-RoPE
positions, and its encoder features once encoded.

Positions come from transformers' `get_rope_index` (`model.omni.RopeIndex`); decode positions
continue as transformers continues them: `index + rope_delta` on all three rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from samebits.model.qwen3_omni.config import OmniConfig
from samebits.requests import MultimodalPrompt


def audio_output_lengths(frames: torch.Tensor, n_window: int) -> torch.Tensor:
    """Audio tokens per audio for `frames` mel frames (transformers' own formula)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    return _get_feat_extract_output_lengths(frames, n_window)


@dataclass
class MultimodalState:
    """One sequence's multimodal state: positions of its prompt and, once encoded, its features."""

    prompt: MultimodalPrompt
    positions: torch.Tensor  # [3, P] float32 M-RoPE positions of the prompt (transformers' dtype)
    rope_delta: torch.Tensor  # [] float32: decode position of index j is j + rope_delta
    feature_index: torch.Tensor  # [N] prompt indices taking encoder features (sorted)
    visual_index: torch.Tensor  # [V] prompt indices of image/video placeholders (sorted)
    embeds: torch.Tensor | None = None  # [N, H] once encoded
    deepstack: list[torch.Tensor] | None = None  # per deepstack layer [V, H] once encoded

    @property
    def needs_encoding(self) -> bool:
        return self.embeds is None and self.feature_index.numel() > 0

    def has_features_in(self, start: int, end: int) -> bool:
        """Whether indices start..end-1 hold a placeholder (never true for decode tokens)."""
        n = self.feature_index.numel()
        return n > 0 and start <= int(self.feature_index[-1]) and end > int(self.feature_index[0])

    def positions_for(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of indices start..end-1 (prompt, then decode continuation)."""
        p = self.positions.shape[1]
        parts = [self.positions[:, start : min(end, p)]]
        if end > p:
            decode = torch.arange(max(start, p), end) + self.rope_delta  # long + float32, as transformers
            parts.append(decode.view(1, -1).expand(3, -1))
        return torch.cat(parts, dim=1)


def check_prompt(mm: MultimodalPrompt, cfg: OmniConfig, has_vision: bool, has_audio: bool) -> str | None:
    """What is wrong with a multimodal prompt (None when nothing is)."""
    ids = torch.tensor(mm.prompt_token_ids, dtype=torch.long)
    merge = cfg.spatial_merge_size**2
    checks = (
        ("image", cfg.image_token_id, "pixel_values", "image_grid_thw", has_vision),
        ("video", cfg.video_token_id, "pixel_values_videos", "video_grid_thw", has_vision),
    )
    for kind, token, pixels_key, grid_key, has_encoder in checks:
        pixels, grid = getattr(mm, pixels_key), getattr(mm, grid_key)
        n_tokens = int((ids == token).sum())
        if (pixels is not None or n_tokens) and not has_encoder:
            return f"the prompt has {kind} input but this checkpoint has no vision encoder"
        if pixels is None and grid is None:
            if n_tokens:
                return f"{n_tokens} {kind} placeholder token(s) but no {pixels_key} / {grid_key}"
            continue
        if pixels is None or grid is None:
            missing = pixels_key if pixels is None else grid_key
            return f"{kind} input without {missing}"
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.dtype.is_floating_point or bool((grid <= 0).any()):
            return f"{grid_key} must be a [n, 3] integer tensor of positive (t, h, w), got {tuple(grid.shape)}"
        patches = int(grid.prod(-1).sum())
        if pixels.dim() != 2 or pixels.shape[0] != patches:
            return f"{pixels_key} has shape {tuple(pixels.shape)} but {grid_key} gives {patches} patches"
        if bool((grid[:, 1:] % cfg.spatial_merge_size != 0).any()):
            return f"{grid_key} h and w must be multiples of spatial_merge_size {cfg.spatial_merge_size}"
        problem = _check_runs(ids, token, cfg.vision_start_token_id, (grid.prod(-1) // merge).tolist(), kind)
        if problem:
            return problem
    if mm.pixel_values_videos is not None:
        spg = mm.video_second_per_grid
        if spg is None or spg.numel() != mm.video_grid_thw.shape[0]:
            return "video input needs video_second_per_grid with one entry per video"
    return _check_audio(mm, ids, cfg, has_audio)


def _check_audio(mm: MultimodalPrompt, ids, cfg: OmniConfig, has_audio: bool) -> str | None:
    feats, mask = mm.input_features, mm.feature_attention_mask
    n_tokens = int((ids == cfg.audio_token_id).sum())
    if (feats is not None or n_tokens) and not has_audio:
        return "the prompt has audio input but this checkpoint has no audio encoder"
    if feats is None and mask is None:
        return f"{n_tokens} audio placeholder token(s) but no input_features" if n_tokens else None
    if feats is None or mask is None:
        return "audio input without " + ("input_features" if feats is None else "feature_attention_mask")
    if feats.dim() != 3 or mask.shape != (feats.shape[0], feats.shape[2]):
        return (
            f"input_features must be [audios, mel, frames] with feature_attention_mask [audios, frames]; "
            f"got {tuple(feats.shape)} and {tuple(mask.shape)}"
        )
    n_window = cfg.thinker.get("audio_config", {}).get("n_window", 50)
    expected = audio_output_lengths(mask.sum(-1), n_window).tolist()
    return _check_runs(ids, cfg.audio_token_id, cfg.audio_start_token_id, expected, "audio")


def _check_runs(ids: torch.Tensor, token: int, start_token: int, expected: list[int], kind: str) -> str | None:
    """Placeholder runs of `token`, each right after `start_token`, must have the expected lengths."""
    runs = _runs(ids, token)
    lengths = [n for _, n in runs]
    if sum(lengths) != sum(expected):
        return f"{sum(lengths)} {kind} placeholder token(s) but the {kind} features have {sum(expected)} rows"
    if lengths != expected:
        return (
            f"{kind} placeholder runs have lengths {lengths}; the features give {expected}, one run per {kind}"
        )
    for begin, _ in runs:
        if begin == 0 or int(ids[begin - 1]) != start_token:
            return f"{kind} placeholder run at index {begin} does not follow its start token {start_token}"
    return None


def _runs(ids: torch.Tensor, token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in ids."""
    out, start = [], None
    for i, t in enumerate(ids.tolist() + [None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            out.append((start, i - start))
            start = None
    return out


def new_state(mm: MultimodalPrompt, cfg: OmniConfig, rope_index) -> MultimodalState:
    """Positions from transformers' `get_rope_index`; features are encoded later, in prefill."""
    ids = torch.tensor(mm.prompt_token_ids, dtype=torch.long)
    seqlens = None if mm.feature_attention_mask is None else mm.feature_attention_mask.sum(-1)
    positions, delta = rope_index(ids, mm.image_grid_thw, mm.video_grid_thw, seqlens, mm.video_second_per_grid)
    placeholders = torch.tensor(cfg.placeholder_token_ids)
    visual = torch.tensor([cfg.image_token_id, cfg.video_token_id])
    return MultimodalState(
        prompt=mm,
        positions=positions,
        rope_delta=delta,
        feature_index=torch.isin(ids, placeholders).nonzero()[:, 0],
        visual_index=torch.isin(ids, visual).nonzero()[:, 0],
    )


def encode(state: MultimodalState, model, cfg: OmniConfig) -> None:
    """Run the thinker's encoders on one prompt's inputs and keep the features on `state`.

    Merged as transformers' thinker forward merges them: audio, image, video features copied to
    their placeholders; deepstack rows of images and videos joined in position order.
    """
    mm, ids = state.prompt, torch.tensor(state.prompt.prompt_token_ids)
    device = next(model.parameters()).device
    hidden = cfg.text.hidden_size
    dtype = model.lm_head.weight.dtype
    embeds = torch.empty(ids.numel(), hidden, dtype=dtype, device=device)  # only placeholder rows used
    deepstack = None
    if mm.input_features is not None:
        audio = model.encode_audio(mm.input_features.to(device), mm.feature_attention_mask.to(device))
        embeds[(ids == cfg.audio_token_id).to(device)] = audio.to(dtype)
    visual_rows = ids[state.visual_index]
    for token, pixels, grid in (
        (cfg.image_token_id, mm.pixel_values, mm.image_grid_thw),
        (cfg.video_token_id, mm.pixel_values_videos, mm.video_grid_thw),
    ):
        if pixels is None:
            continue
        merged, levels = model.encode_visual(pixels.to(device), grid.to(device))
        embeds[(ids == token).to(device)] = merged.to(dtype)
        if deepstack is None:
            deepstack = [
                torch.zeros(visual_rows.numel(), hidden, dtype=levels[0].dtype, device=device) for _ in levels
            ]
        for joint, level in zip(deepstack, levels, strict=True):
            joint[(visual_rows == token).to(device)] = level
    state.embeds = embeds[state.feature_index.to(device)]
    state.deepstack = deepstack or []
