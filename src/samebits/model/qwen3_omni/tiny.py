"""A tiny random Qwen3-Omni (thinker with tiny vision and audio encoders, tiny talker and
code2wav), saved by transformers itself in the released layout, and synthetic prompts for it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from samebits.model.qwen3_omni.inputs import audio_output_lengths
from samebits.requests import MultimodalPrompt

IDS = dict(
    vision_start_token_id=376,
    vision_end_token_id=377,
    audio_start_token_id=378,
    audio_end_token_id=379,
    image_token_id=380,
    video_token_id=381,
    audio_token_id=382,
)
TEXT = dict(
    vocab_size=384,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=3,
    mlp_only_layers=[1],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    moe_intermediate_size=48,
    num_experts=6,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [4, 4, 4],
        "interleaved": True,
    },
    rms_norm_eps=1e-6,
    eos_token_id=1,
    bos_token_id=0,
)
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=96,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1],  # deepstack into decoder layers 0 and 1 (2 of 3)
)
AUDIO = dict(
    num_mel_bins=16,
    encoder_layers=1,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    d_model=32,
    output_dim=96,
    n_window=50,  # transformers' output-length formula assumes 100-frame chunks
    n_window_infer=200,
    downsample_hidden_size=8,
    max_source_positions=128,
)
_TALKER_ROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3], "interleaved": True}
_TALKER = dict(
    text_config=dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=2, num_experts_per_tok=1,
        shared_expert_intermediate_size=16,
        rope_parameters=_TALKER_ROPE,
    ),
    code_predictor_config=dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_code_groups=4,
    ),
    num_code_groups=4, thinker_hidden_size=96, accept_hidden_layer=1, spatial_merge_size=2,
)  # fmt: skip
_CODE2WAV = dict(
    codebook_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
    num_hidden_layers=1, num_quantizers=4, upsample_rates=[2, 2], upsampling_ratios=[2], decoder_dim=32,
    sliding_window=8,
)  # fmt: skip


def thinker_config(**text_overrides):
    from transformers import Qwen3OmniMoeThinkerConfig

    ids = {k: v for k, v in IDS.items() if not k.endswith("end_token_id")}
    return Qwen3OmniMoeThinkerConfig(
        text_config=TEXT | text_overrides,
        vision_config=VISION,
        audio_config=AUDIO,
        position_id_per_seconds=25,
        **ids,
    )


def build_tiny_thinker(seed: int = 0, dtype: torch.dtype = torch.bfloat16, **text_overrides):
    """A random `Qwen3OmniMoeThinkerForConditionalGeneration` (weights larger than HF's init)."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(thinker_config(**text_overrides))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            is_norm = name.endswith(
                ("norm.weight", "ln_q.weight", "ln_post.weight", "norm1.weight", "norm2.weight")
            )
            p.copy_(1 + 0.1 * noise if is_norm else 0.08 * noise)
    return model.to(dtype).eval()


def build_tiny_omni_checkpoint(
    path: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "full",
    per_expert_layout: bool = True,
    audio: bool = True,
) -> Path:
    """Save the tiny thinker with transformers' `save_pretrained`.

    layout="full": a `Qwen3OmniMoeForConditionalGeneration` (thinker.* beside talker.* and
    code2wav.*, as released); "thinker": the thinker alone. per_expert_layout writes experts per
    expert (transformers' default and the released layout), else fused. audio=False removes the
    audio encoder's tensors afterwards (a checkpoint without an audio encoder).
    """
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    path = Path(path)
    thinker = build_tiny_thinker(seed, dtype)
    if layout == "full":
        cfg = Qwen3OmniMoeConfig(
            thinker_config=thinker.config.to_dict(), talker_config=_TALKER, code2wav_config=_CODE2WAV
        )
        torch.manual_seed(seed + 1)
        model = Qwen3OmniMoeForConditionalGeneration(cfg).to(dtype)
        model.thinker.load_state_dict(thinker.state_dict())
    elif layout == "thinker":
        model = thinker
    else:
        raise ValueError(f"layout must be 'full' or 'thinker', got {layout!r}")
    model.save_pretrained(path, save_original_format=per_expert_layout)
    if not audio:
        _drop_tensors(path, "audio_tower.")
    return path


def _drop_tensors(path: Path, marker: str) -> None:
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            kept = {n: fh.get_tensor(n) for n in fh.keys() if marker not in n}
        save_file(kept, str(f), metadata={"format": "pt"})


# -- synthetic prompts ----------------------------------------------------------------------


def _text(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(2, IDS["vision_start_token_id"], (n,), generator=g).tolist()


def image_part(g: torch.Generator, grid=(1, 4, 6), video: bool = False, seconds: float = 1.0) -> dict:
    """One image (or video) of grid (t, h, w) patches: placeholders and processor tensors."""
    t, h, w = grid
    patch = 3 * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    n = t * h * w // VISION["spatial_merge_size"] ** 2
    token = IDS["video_token_id" if video else "image_token_id"]
    ids = [IDS["vision_start_token_id"], *[token] * n, IDS["vision_end_token_id"]]
    pixels = torch.randn(t * h * w, patch, generator=g)
    grid_t = torch.tensor([grid])
    if video:
        return dict(
            ids=ids,
            pixel_values_videos=pixels,
            video_grid_thw=grid_t,
            video_second_per_grid=torch.tensor([seconds]),
        )
    return dict(ids=ids, pixel_values=pixels, image_grid_thw=grid_t)


def audio_part(g: torch.Generator, frames: int = 130) -> dict:
    n = int(audio_output_lengths(torch.tensor(frames), AUDIO["n_window"]))
    ids = [IDS["audio_start_token_id"], *[IDS["audio_token_id"]] * n, IDS["audio_end_token_id"]]
    feats = torch.randn(1, AUDIO["num_mel_bins"], frames, generator=g)
    return dict(ids=ids, input_features=feats, feature_attention_mask=torch.ones(1, frames, dtype=torch.long))


def make_prompt(seed: int, parts: list[dict], text_lens: list[int]) -> MultimodalPrompt:
    """Text runs of `text_lens` around the parts: text, part, text, part, ..., text."""
    if len(text_lens) != len(parts) + 1:
        raise ValueError("need one text run more than parts")
    g = torch.Generator().manual_seed(seed)
    ids = _text(g, text_lens[0])
    tensors: dict[str, list] = {}
    for part, n in zip(parts, text_lens[1:], strict=True):
        ids += part["ids"] + _text(g, n)
        for k, v in part.items():
            if k != "ids":
                tensors.setdefault(k, []).append(v)
    joined = {k: _join(k, vs) for k, vs in tensors.items()}
    return MultimodalPrompt(prompt_token_ids=ids, **joined)


def _join(key: str, values: list[torch.Tensor]) -> torch.Tensor:
    if key in ("input_features", "feature_attention_mask"):
        frames = max(v.shape[-1] for v in values)
        values = [torch.nn.functional.pad(v, (0, frames - v.shape[-1])) for v in values]
    return torch.cat(values)
