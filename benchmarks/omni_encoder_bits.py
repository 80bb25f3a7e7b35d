"""The Qwen3-Omni encoders at the released shapes: each prompt alone vs all prompts batched.

The engine encodes each prompt's image/audio alone; the trainer encodes a batch's together.
Both run inside `batch_invariant()`, where the encoders' GEMMs, LayerNorms, convolutions and
softmaxes take samebits' row-invariant kernels. This script builds transformers' vision and
audio encoders with the released Qwen3-Omni-30B-A3B encoder configs (transformers' defaults,
output width 2048) and random bf16 weights, encodes two images and two audios alone and
batched, and prints how many output elements differ, inside the context and on stock kernels.

    python benchmarks/omni_encoder_bits.py              # CPU, ~a few minutes
    python benchmarks/omni_encoder_bits.py --device cuda
"""

from __future__ import annotations

import argparse
import contextlib

import torch


def _encoders(device):
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig,
        Qwen3OmniMoeVisionEncoderConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoder,
        Qwen3OmniMoeVisionEncoder,
    )

    torch.manual_seed(0)
    vcfg = Qwen3OmniMoeVisionEncoderConfig(out_hidden_size=2048)
    acfg = Qwen3OmniMoeAudioEncoderConfig(output_dim=2048)
    for cfg in (vcfg, acfg):
        cfg._attn_implementation = "eager"  # as samebits runs the encoders
    with torch.device(device):
        vision = Qwen3OmniMoeVisionEncoder(vcfg).to(torch.bfloat16).eval()
        audio = Qwen3OmniMoeAudioEncoder(acfg).to(torch.bfloat16).eval()
    return vision, audio, vcfg, acfg


def _vision_inputs(cfg, grids, device):
    g = torch.Generator().manual_seed(1)
    per_patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    pixels = [torch.randn(int(t * h * w), per_patch, generator=g).to(device) for t, h, w in grids]
    return pixels, [torch.tensor([grid], device=device) for grid in grids]


def _audio_inputs(cfg, frames, device):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(cfg.num_mel_bins, n, generator=g).to(device) for n in frames]


def _vision(model, pixels, grids):
    out = model(torch.cat(pixels).bfloat16(), grid_thw=torch.cat(grids), return_dict=True)
    return [out.pooler_output, *out.deepstack_features]


def _audio(model, feats):
    lens = torch.tensor([f.shape[1] for f in feats], device=feats[0].device)
    return [model(torch.cat(feats, dim=1).bfloat16(), feature_lens=lens, return_dict=True).last_hidden_state]


def _mismatches(alone_parts: list[list[torch.Tensor]], batched: list[torch.Tensor]) -> int:
    """Elements of the batched outputs that differ from the per-prompt outputs, concatenated."""
    joined = [torch.cat(level) for level in zip(*alone_parts, strict=True)]
    return sum(
        int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(joined, batched, strict=True)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    from samebits import batch_invariant

    vision, audio, vcfg, acfg = _encoders(args.device)
    pixels, grids = _vision_inputs(vcfg, [(1, 8, 8), (1, 12, 8)], args.device)
    feats = _audio_inputs(acfg, [230, 170], args.device)
    for name, ctx in (("batch_invariant()", batch_invariant), ("stock kernels", contextlib.nullcontext)):
        with torch.inference_mode(), ctx():
            v_alone = [_vision(vision, [px], [gr]) for px, gr in zip(pixels, grids, strict=True)]
            v_batch = _vision(vision, pixels, grids)
            a_alone = [_audio(audio, [f]) for f in feats]
            a_batch = _audio(audio, feats)
        v_total = sum(t.numel() for t in v_batch)
        a_total = sum(t.numel() for t in a_batch)
        print(f"{name:>18}: vision alone vs batched {_mismatches(v_alone, v_batch)}/{v_total} differ; ", end="")
        print(f"audio {_mismatches(a_alone, a_batch)}/{a_total} differ", flush=True)


if __name__ == "__main__":
    main()
