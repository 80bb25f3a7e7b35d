"""The trainer's side for the Qwen3-Omni thinker: transformers'
`Qwen3OmniMoeThinkerForConditionalGeneration` with samebits experts and text attention.

`token_logprobs` handles its multimodal sequences through the Omni model family
(`model/qwen3_omni/family.py`): 4-row positions [text; T; H; W] and the processor tensors.
"""

from __future__ import annotations

import torch

from samebits.model.families import check_checkpoint_config
from samebits.model.qwen3_omni.model import ENCODER_ATTENTION, reset_encoder_buffers
from samebits.numerics.ops import rotary_inv_freq
from samebits.trainer.drift import check_transformers_numerics
from samebits.trainer.hub_kernels import refuse_hub_kernels
from samebits.trainer.swap import use_samebits_forwards

TEXT_ATTENTION = {"": "samebits", "text_config": "samebits"}


def load_hf_thinker(
    path, device="cpu", dtype: torch.dtype = torch.bfloat16, *, samebits_forwards: bool = True, **kwargs
):
    """The transformers thinker (from a full Omni or a thinker-only checkpoint) with samebits
    experts and text attention; encoders on eager attention; rotary/sinusoid buffers from the
    CPU. `samebits_forwards` as in `load_hf_model`."""
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
        path, dtype=dtype, attn_implementation=attn, **refuse_hub_kernels(kwargs)
    ).to(device)
    reset_thinker_buffers(model)
    check_transformers_numerics(model)  # trainer/drift.py
    if samebits_forwards:
        use_samebits_forwards(model, check=False)
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
