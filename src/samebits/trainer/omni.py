"""The trainer's side for the Qwen3-Omni thinker: transformers'
`Qwen3OmniMoeThinkerForConditionalGeneration` with samebits experts and text attention,
teacher-forced log-probs of multimodal sequences, one at a time or packed.

Positions are passed explicitly as transformers' 4-row form [text; T; H; W]: the text row is
0..n-1 per sequence (what packed attention reads its boundaries from), the T/H/W rows are
the thinker's own `get_rope_index` for the prompt and `index + rope_delta` for the response,
exactly what `generate` feeds the model step by step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from samebits.engine.multimodal import MultimodalPrompt, as_multimodal
from samebits.model.config import check_checkpoint_config
from samebits.model.omni import ENCODER_ATTENTION, reset_encoder_buffers
from samebits.numerics.ops import reported_logprobs, rotary_inv_freq

TEXT_ATTENTION = {"": "samebits", "text_config": "samebits"}


def load_hf_thinker(path, device="cpu", dtype: torch.dtype = torch.bfloat16, **kwargs):
    """The transformers thinker (from a full Omni or a thinker-only checkpoint) with samebits
    experts and text attention; encoders on eager attention; rotary/sinusoid buffers from the CPU."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    check_checkpoint_config(path)  # refuse what the engine refuses, before any weight is read
    kwargs.setdefault("experts_implementation", "samebits")
    attn = kwargs.pop("attn_implementation", "samebits")
    if isinstance(attn, str):  # one text attention; encoders stay on the encoders' implementation
        attn = {
            "": attn,
            "text_config": attn,
            "vision_config": ENCODER_ATTENTION,
            "audio_config": ENCODER_ATTENTION,
        }
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        path, dtype=dtype, attn_implementation=attn, **kwargs
    ).to(device)
    reset_thinker_buffers(model)
    return model.eval()


def reset_thinker_buffers(model) -> None:
    """Text rotary `inv_freq` and the encoders' buffers from the CPU fp32 formulas."""
    rotary = model.model.language_model.rotary_emb
    cfg = rotary.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    expected = rotary_inv_freq(head_dim, cfg.rope_parameters["rope_theta"])
    rotary.inv_freq = expected.to(rotary.inv_freq.device)
    rotary.original_inv_freq = rotary.inv_freq.clone()
    reset_encoder_buffers(model.model.visual, model.model.audio_tower)


def is_thinker(model) -> bool:
    return type(model).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"


def thinker_positions(model, seq: Sequence[int], mm: MultimodalPrompt) -> torch.Tensor:
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


def thinker_token_logprobs(
    model,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    multimodal: Sequence | None = None,
    packed: bool = False,
    temperature: float = 1.0,
    with_grad: bool = False,
) -> list[torch.Tensor]:
    """`token_logprobs` for the thinker; multimodal[i] is sequence i's prompt (a MultimodalPrompt,
    a processor dict, or None for a text-only prompt)."""
    n = len(sequences)
    prompts = []
    for i in range(n):
        mm = as_multimodal(multimodal[i]) if multimodal is not None and multimodal[i] is not None else None
        mm = mm or MultimodalPrompt(list(sequences[i][: prompt_lens[i]]))
        if list(sequences[i][: len(mm.prompt_token_ids)]) != list(mm.prompt_token_ids) or prompt_lens[i] != len(
            mm.prompt_token_ids
        ):
            raise ValueError(f"sequence {i}: does not start with its multimodal prompt's token ids")
        prompts.append(mm)
    temp = 1.0 if temperature == 0 else float(temperature)
    device = next(model.parameters()).device
    groups = [list(range(n))] if packed else [[i] for i in range(n)]
    out: list[torch.Tensor | None] = [None] * n
    with torch.set_grad_enabled(with_grad):
        for group in groups:
            ids = torch.tensor([t for i in group for t in sequences[i]], device=device)
            pos = torch.cat([thinker_positions(model, sequences[i], prompts[i]) for i in group], dim=1)
            extra = _packed_inputs([prompts[i] for i in group], device)
            logits = model(
                input_ids=ids[None], position_ids=pos[:, None].to(device), use_cache=False, **extra
            ).logits[0]
            offset = 0
            for i in group:
                length, p = len(sequences[i]), prompt_lens[i]
                rows = logits[offset + p - 1 : offset + length - 1]  # [n - p, V]
                lp = reported_logprobs(rows, [temp] * rows.shape[0])
                out[i] = lp.gather(-1, ids[offset + p : offset + length, None])[:, 0]
                offset += length
    return out  # type: ignore[return-value]
