"""The Qwen3-Omni thinker for the rollout: the Qwen3-MoE decoder with M-RoPE and
deepstack, fed by transformers' own audio and vision encoders.

Parameter names are those of transformers' `Qwen3OmniMoeThinkerForConditionalGeneration`
(`model.language_model.layers.0...`, `model.visual.blocks.0...`,
`model.audio_tower.layers.0...`, `lm_head.weight`), so the trainer's
`named_parameters()` sync without conversion. The text decoder is the Qwen3-MoE text
model fed `inputs_embeds`, with M-RoPE and deepstack added, following
`Qwen3OmniMoeThinkerTextModel.forward` op for op:

    hidden = embed(ids), encoder features copied in at placeholder rows   (inputs_embeds)
    cos, sin = mrope_cos_sin(T/H/W positions)
    for each layer i: hidden = layer(hidden); if i < len(deepstack):
        hidden = deepstack_add(hidden, visual rows, deepstack[i])   # (residual + mlp) + deepstack

Shapes: T = tokens in the step, H = hidden, M = rows taking encoder features,
V = visual rows (image and video placeholders) in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from samebits.model.attention import AttentionBatch
from samebits.model.qwen3_moe.model import Qwen3MoeModel, dense
from samebits.model.qwen3_omni.config import OmniConfig
from samebits.numerics import ops

ENCODER_ATTENTION = "eager"  # per-image/per-window attention through the batch-invariant bmm/softmax


@dataclass(frozen=True)
class MultimodalRows:
    """Encoder outputs for one step, placed by row in T."""

    rows: torch.Tensor  # [M] rows in T whose input embedding is an encoder feature
    embeds: torch.Tensor  # [M, H]
    visual_mask: torch.Tensor  # [T] bool: image/video placeholder rows (deepstack targets)
    deepstack: tuple[torch.Tensor, ...]  # per deepstack layer: [V, H], V = visual_mask.sum()


class ThinkerTextModel(Qwen3MoeModel):
    """transformers' `Qwen3OmniMoeThinkerTextModel`: the Qwen3-MoE text model, fed `inputs_embeds`
    by the thinker, with M-RoPE positions [3, T] and deepstack after the first layers."""

    def __init__(self, cfg: OmniConfig):
        super().__init__(cfg.text)
        self.mrope_section = list(cfg.mrope_section)

    def rotary(self, hidden, positions):  # positions [3, T] T/H/W rows -> cos, sin [T, D]
        return ops.mrope_cos_sin(hidden, positions, self.inv_freq, 1.0, self.mrope_section)

    def decoder_layer(self, i, layer, hidden, mlp_out, cos, sin, meta, kv_cache, multimodal=None):
        hidden, mlp_out = layer(hidden, cos, sin, meta, kv_cache, mlp_out)
        if not _has_deepstack(multimodal, i):
            return hidden, mlp_out
        # (res + mlp) + ds: the residual add made here, before the deepstack rows
        return ops.deepstack_add(hidden + dense(mlp_out), multimodal.visual_mask, multimodal.deepstack[i]), None


def _has_deepstack(mm: MultimodalRows | None, i: int) -> bool:
    return mm is not None and i < len(mm.deepstack) and mm.deepstack[i].shape[0] > 0


class SplitResidualDeepstackTextModel(ThinkerTextModel):
    """The known trap, for negative controls only: deepstack folded into the split residual
    stream, `(residual + deepstack) + mlp` instead of transformers' `(residual + mlp) + deepstack`."""

    def decoder_layer(self, i, layer, hidden, mlp_out, cos, sin, meta, kv_cache, multimodal=None):
        residual, mlp_out = layer(hidden, cos, sin, meta, kv_cache, mlp_out)
        if _has_deepstack(multimodal, i):  # the MLP output is added in the next norm: after ds
            residual = ops.deepstack_add(residual, multimodal.visual_mask, multimodal.deepstack[i])
        return residual, mlp_out


class ThinkerModel(nn.Module):
    """transformers' `Qwen3OmniMoeThinkerModel`: encoders (None when the checkpoint has none) + text."""

    def __init__(self, cfg: OmniConfig, has_vision: bool, has_audio: bool):
        super().__init__()
        vision_cls, audio_cls = _encoder_classes()
        hf = cfg.hf_thinker_config()
        self.audio_tower = (
            audio_cls._from_config(hf.audio_config, attn_implementation=ENCODER_ATTENTION)
            if has_audio
            else None
        )
        self.visual = (
            vision_cls._from_config(hf.vision_config, attn_implementation=ENCODER_ATTENTION)
            if has_vision
            else None
        )
        self.language_model = ThinkerTextModel(cfg)


class Qwen3OmniThinker(nn.Module):
    """The rollout's thinker: `forward` runs the text decoder on one step, `encode_*` the encoders."""

    def __init__(self, cfg: OmniConfig, has_vision: bool, has_audio: bool):
        super().__init__()
        self.config = cfg.text
        self.omni = cfg
        self.model = ThinkerModel(cfg, has_vision, has_audio)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        if cfg.text.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def forward(
        self,
        input_ids,
        positions,
        meta: AttentionBatch,
        kv_caches,
        multimodal: MultimodalRows | None = None,
    ) -> torch.Tensor:
        """input_ids [T], positions [3, T], the step's encoder features -> hidden [T, H]."""
        embeds = None if multimodal is None else self.embed_input_ids(input_ids, multimodal)
        return self.model.language_model(
            input_ids, positions, meta, kv_caches, inputs_embeds=embeds, multimodal=multimodal
        )

    def embed_input_ids(self, input_ids, multimodal: MultimodalRows) -> torch.Tensor:
        """[T, H] token embeddings with the encoder features copied in at their rows."""
        hidden = self.model.language_model.embed_tokens(input_ids)
        return hidden.index_put((multimodal.rows,), multimodal.embeds.to(hidden.dtype))  # HF: masked_scatter

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V] in the activation dtype, as transformers

    def finish_load(self) -> None:
        """After the weights are assigned: tie lm_head if configured; text rotary `inv_freq` and
        the encoders' buffers from the CPU fp32 formulas, as the trainer's thinker gets them."""
        text = self.model.language_model
        if self.config.tie_word_embeddings:
            self.lm_head.weight = text.embed_tokens.weight
        text.inv_freq = ops.rotary_inv_freq(self.config.head_dim, self.config.rope_theta)
        reset_encoder_buffers(self.model.visual, self.model.audio_tower)

    # -- encoders: the calls of transformers' Qwen3OmniMoeThinkerModel.get_*_features ------------

    def encode_visual(self, pixel_values, grid_thw) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> merged features [N, H] and one [N, H] per deepstack layer, N = sum(grid.prod()) / merge^2."""
        out = self.model.visual(pixel_values.type(self.model.visual.dtype), grid_thw=grid_thw, return_dict=True)
        return out.pooler_output, list(out.deepstack_features)

    def encode_audio(self, input_features, feature_attention_mask) -> torch.Tensor:
        """input_features [A, mel, frames] padded, mask [A, frames] -> features [N, H]."""
        lens = torch.sum(feature_attention_mask, dim=1)
        feats = input_features.permute(0, 2, 1)[feature_attention_mask.bool()].permute(1, 0)
        return self.model.audio_tower(feats, feature_lens=lens, return_dict=True).last_hidden_state


def _encoder_classes():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoder,
        Qwen3OmniMoeVisionEncoder,
    )

    return Qwen3OmniMoeVisionEncoder, Qwen3OmniMoeAudioEncoder


def reset_encoder_buffers(visual, audio_tower) -> None:
    """Recompute the encoders' non-persistent buffers on the CPU in fp32 (vision rotary `inv_freq`,
    audio sinusoids), as for the text rotary: the rollout and the trainer then hold the same bits."""
    if visual is not None:
        rotary = visual.rotary_pos_emb
        inv_freq, _ = rotary.compute_axial_rope_parameters(rotary.config)
        rotary.inv_freq = inv_freq.to(torch.float32).to(rotary.inv_freq.device)
        rotary.original_inv_freq = rotary.inv_freq.clone()
    if audio_tower is not None:
        pe = audio_tower.positional_embedding
        table = pe.compute_default_singular_positional_embedding().to(torch.float32)
        pe.positional_embedding = table.to(pe.positional_embedding.device)


class RopeIndex:
    """transformers' thinker position logic (`get_rope_index`), called as transformers defines it.

    The functions are taken from `Qwen3OmniMoePreTrainedModelForConditionalGeneration`, so the
    positions are transformers' own; only `config` and `spatial_merge_size` are supplied.
    """

    def __init__(self, cfg: OmniConfig):
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoePreTrainedModelForConditionalGeneration as Base,
        )

        self.config = cfg.hf_thinker_config()
        self.spatial_merge_size = cfg.spatial_merge_size
        self._get_rope_index = Base.get_rope_index
        self.get_llm_pos_ids_for_vision = Base.get_llm_pos_ids_for_vision.__get__(self)

    def __call__(self, input_ids, image_grid_thw, video_grid_thw, audio_seqlens, second_per_grids):
        """input_ids [S] -> (positions [3, S], rope_delta [] ), float32 as transformers makes them
        (video time positions can be fractional)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)[None]
        pos, delta = self._get_rope_index(
            self,
            ids,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            attention_mask=torch.ones_like(ids),
            use_audio_in_video=False,
            audio_seqlens=audio_seqlens,
            second_per_grids=second_per_grids,
        )
        return pos[:, 0], delta.reshape(-1)[0]
