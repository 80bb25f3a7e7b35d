"""The Qwen3-Omni thinker parity probe: text, image, video (and mixed) prompts, bitwise.

    python benchmarks/probe_omni.py --layers 48 --tokens 200 --out probe_omni.json   # CUDA
    python benchmarks/probe_omni.py --layers 48 --no-cuda-graphs                        # eager decode
    python benchmarks/probe_omni.py --tiny --device cpu                                # tiny, CPU

Writes a random thinker-only checkpoint at the Qwen3-Omni-30B-A3B thinker shape (text:
48 layers, hidden 2048, 128 experts top-8, 32/4 heads, head_dim 128, M-RoPE [24, 20, 20];
the released vision and audio encoder shapes) under transformers 5.x names, or with --tiny
the test suite's tiny Omni checkpoint (released layout, thinker.* beside talker.*). Then:
rollout each prompt alone and all batched; trainer (transformers' thinker, samebits experts
and attention) one at a time and packed; the negative control: the rollout with deepstack
added into the split residual, which must mismatch on the visual prompts. Prints the median
wall time of a decode step of the batched rollout (CUDA graphs unless --no-cuda-graphs).

Disk and memory: 48 layers are ~61 GB of bf16 weights on disk and on the device (the rollout
is freed before the trainer loads); pass --dir on a disk with room.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

QWEN3_OMNI_TEXT = dict(
    vocab_size=152064, hidden_size=2048, intermediate_size=768, moe_intermediate_size=768,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=65536, decoder_sparse_step=1,
    rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[24, 20, 20], interleaved=True),
)  # fmt: skip
QWEN3_OMNI_VISION = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, temporal_patch_size=2,
    spatial_merge_size=2, out_hidden_size=2048, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)  # fmt: skip
QWEN3_OMNI_AUDIO = dict(
    num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120, d_model=1280,
    output_dim=2048, n_window=50, n_window_infer=400, downsample_hidden_size=480, max_source_positions=1500,
)  # fmt: skip
IDS = dict(image_token_id=151655, video_token_id=151656, audio_token_id=151646,
           vision_start_token_id=151652, audio_start_token_id=151647)  # fmt: skip
VISION_END, IM_END = 151653, 151645


def thinker_config(layers: int):
    from transformers import Qwen3OmniMoeThinkerConfig

    text = QWEN3_OMNI_TEXT | {"num_hidden_layers": layers, "eos_token_id": IM_END}
    return Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=QWEN3_OMNI_VISION, audio_config=QWEN3_OMNI_AUDIO, **IDS
    )


def write_random_thinker(path: Path, layers: int, seed: int, device: str) -> Path:
    """Random bf16 weights for every tensor of transformers' thinker (shapes from a meta build)."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    from samebits.model.qwen3_moe.loader import save_tensor_stream

    cfg = thinker_config(layers)
    with torch.device("meta"):
        shapes = {
            n: tuple(t.shape) for n, t in Qwen3OmniMoeThinkerForConditionalGeneration(cfg).state_dict().items()
        }
    g = torch.Generator(device=device).manual_seed(seed)

    def tensors():  # one at a time: save_tensor_stream keeps one 4 GiB shard in host memory
        for name, shape in shapes.items():
            noise = torch.randn(shape, device=device, generator=g)
            if len(shape) == 1:
                norm = "norm" in name or "ln_" in name
                t = 1 + 0.1 * noise if norm and name.endswith("weight") else 0.02 * noise
            else:
                t = noise * (torch.tensor(shape[1:]).prod().item()) ** -0.5
            yield name, t.bfloat16()

    cfg_dict = cfg.to_dict() | {
        "architectures": ["Qwen3OmniMoeThinkerForConditionalGeneration"],
        "dtype": "bfloat16",
    }
    return save_tensor_stream(cfg_dict, tensors(), path, max_shard_bytes=4 << 30)


def real_prompts(seed: int) -> dict:
    from samebits.requests import MultimodalPrompt

    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(1000, 150000, (n,), generator=g).tolist()  # noqa: E731
    patch = 3 * 2 * 16 * 16

    def vision(grid, video):
        t, h, w = grid
        token = IDS["video_token_id" if video else "image_token_id"]
        ids = [IDS["vision_start_token_id"], *[token] * (t * h * w // 4), VISION_END]
        return ids, torch.randn(t * h * w, patch, generator=g), torch.tensor([grid])

    img_ids, img, img_grid = vision((1, 32, 24), False)
    vid_ids, vid, vid_grid = vision((4, 16, 16), True)
    seconds = torch.tensor([1.0])
    return {
        "text": MultimodalPrompt(text(40)),
        "image": MultimodalPrompt(text(12) + img_ids + text(20), pixel_values=img, image_grid_thw=img_grid),
        "video": MultimodalPrompt(
            text(8) + vid_ids + text(16),
            pixel_values_videos=vid,
            video_grid_thw=vid_grid,
            video_second_per_grid=seconds,
        ),
        "mixed": MultimodalPrompt(
            text(5) + img_ids + text(7) + vid_ids + text(9),
            pixel_values=img, image_grid_thw=img_grid,
            pixel_values_videos=vid, video_grid_thw=vid_grid, video_second_per_grid=seconds,
        ),
    }  # fmt: skip


def tiny_prompts() -> dict:
    from samebits.model.qwen3_omni.tiny import audio_part, image_part, make_prompt

    g = torch.Generator().manual_seed(3)
    return {
        "text": make_prompt(1, [], [11]),
        "image": make_prompt(2, [image_part(g, (1, 4, 6))], [5, 4]),
        "video": make_prompt(3, [image_part(g, (2, 4, 4), video=True, seconds=0.5)], [3, 6]),
        "audio": make_prompt(4, [audio_part(g, 230)], [4, 3]),
        "mixed": make_prompt(
            5,
            [image_part(g, (1, 2, 4)), audio_part(g, 130), image_part(g, (2, 2, 2), video=True)],
            [2, 3, 2, 5],
        ),
    }


def timed_decode_steps(llm, prompts, params):
    """llm.generate's outputs and the wall time (ms) of each decode step (every chunk one token)."""
    runner, times = llm.runner, []
    launch = runner.launch
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)

    def timed(batch, reqs, ahead=None):
        if not all(c.num_tokens == 1 for c in batch.chunks):
            return launch(batch, reqs, ahead)
        sync()
        t0 = time.perf_counter()
        out = launch(batch, reqs, ahead)
        out.result()  # (the step, waited for: no step overlaps another while timed)
        sync()
        times.append(1000 * (time.perf_counter() - t0))
        return out

    runner.launch = timed
    try:
        return llm.generate(prompts, params), times
    finally:
        del runner.launch


def run(path, prompts: dict, device: str, tokens: int, seed: int, log=print, cuda_graphs: bool = True):
    """-> list of verify.ArmResult: alone vs batched, trainer one-at-a-time / packed, the negative control."""
    from samebits import LLM, SamplingParams, batch_invariant, trainer
    from samebits.model.qwen3_omni.model import SplitResidualDeepstackTextModel, ThinkerTextModel
    from samebits.verify import compare

    kinds, plist = list(prompts), list(prompts.values())
    params = [
        SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=seed + i)
        for i in range(len(plist))
    ]
    max_len = max(len(p.prompt_token_ids) for p in plist) + tokens
    llm = LLM(path, device=device, max_num_seqs=8, max_model_len=max_len, cuda_graphs=cuda_graphs)
    t0 = time.perf_counter()
    batched, steps = timed_decode_steps(llm, plist, params)
    log(f"rollout batched: {time.perf_counter() - t0:.1f} s")
    mode = "CUDA graphs" if llm.runner.graphs is not None else "eager"
    log(
        f"decode step ({len(plist)} sequences, {mode}): median {statistics.median(steps):.2f} ms, "
        f"min {min(steps):.2f} ms over {len(steps)} steps"
    )
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(plist, params, strict=True)]
    text_model = llm.model.model.language_model
    text_model.__class__ = (
        SplitResidualDeepstackTextModel  # negative control: same weights, wrong deepstack order
    )
    try:
        wrong = llm.generate(plist, params)
    finally:
        text_model.__class__ = ThinkerTextModel
    del llm, text_model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    results = [
        compare("rollout alone vs batched", i, True, a.logprobs, b.logprobs)
        for i, (a, b) in enumerate(zip(alone, batched, strict=True))
    ]
    for r, a, b in zip(results, alone, batched, strict=True):
        r.mismatches = max(r.mismatches, int(a.token_ids != b.token_ids))
    model = trainer.load_hf_thinker(path, device=device)

    def recompute(outs, packed):
        seqs = [o.prompt_token_ids + o.token_ids for o in outs]
        with batch_invariant():
            return trainer.token_logprobs(
                model, seqs, [len(o.prompt_token_ids) for o in outs], packed=packed, multimodal=plist
            )

    for name, packed in (("trainer one-at-a-time", False), ("trainer packed", True)):
        log(f"trainer: {name}")
        lps = recompute(batched, packed)
        results += [
            compare(name, i, True, lp, o.logprobs) for i, (lp, o) in enumerate(zip(lps, batched, strict=True))
        ]
    log("trainer: packed, on the negative control's rollout")
    lps = recompute(wrong, True)
    visual = [i for i, k in enumerate(kinds) if k in ("image", "video", "mixed")]
    results += [compare("NEG deepstack in split residual", i, False, lps[i], wrong[i].logprobs) for i in visual]
    for r in results:
        r.arm = f"{r.arm} [{kinds[r.seq]}]"
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--tiny", action="store_true", help="the tiny Omni test checkpoint instead of the real shape"
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode in CUDA graphs (on CUDA; default) or eagerly",
    )
    p.add_argument("--dir", default="/tmp/samebits-probe-omni")
    p.add_argument(
        "--reuse", action="store_true", help="use the checkpoint already in --dir (written by an earlier run)"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from samebits import verify

    t0 = time.time()
    if args.tiny:
        from samebits.model.qwen3_omni.tiny import build_tiny_omni_checkpoint

        path, prompts = build_tiny_omni_checkpoint(Path(args.dir), seed=args.seed), tiny_prompts()
    else:
        reuse = args.reuse and (Path(args.dir) / "config.json").is_file()
        path = (
            Path(args.dir)
            if reuse
            else write_random_thinker(Path(args.dir), args.layers, args.seed, args.device)
        )
        prompts = real_prompts(args.seed)
    print(f"checkpoint at {path} in {time.time() - t0:.0f} s", flush=True)
    t0 = time.time()
    results = run(path, prompts, args.device, args.tokens, args.seed, cuda_graphs=args.cuda_graphs)
    print(f"probe: {time.time() - t0:.0f} s", flush=True)
    verify.print_table(results)
    for r in results:
        print(
            f"{r.arm:48s} {'exact' if r.exact else 'NEG':5s} {r.mismatches}/{r.total} first={r.first_mismatch}"
        )
    print("PASS" if verify.passed(results) else "FAIL")
    if args.out:
        verify.write_json(results, args.out)


if __name__ == "__main__":
    main()
