"""Decode step time of the Qwen3-Omni thinker through `LLM.generate`, eager against CUDA graphs.

    python benchmarks/omni_decode.py --layers 48 --batches 1,8,32 --dir /dev/shm/omni48

Writes (or reuses) a random thinker-only checkpoint at the Qwen3-Omni-30B-A3B thinker shape
(`probe_omni.write_random_thinker`), then for each arm (`cuda_graphs` off / on) and batch size B
generates B text prompts of 64 tokens twice, with `--short` and `--long` new tokens
(`ignore_eos`), and prints the decode time per extra token: (t_long - t_short) / (long - short).
Each arm also checks that its tokens and log-probs equal the first arm's, bit for bit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from probe_omni import write_random_thinker  # noqa: E402


def timed(llm, prompts, params) -> tuple[float, list]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, progress=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=80)
    p.add_argument("--arms", default="eager,graphs")
    p.add_argument("--dir", default="/dev/shm/samebits-omni-decode")
    args = p.parse_args()
    from samebits import LLM, SamplingParams

    path = Path(args.dir)
    if not (path / "config.json").is_file():
        t0 = time.time()
        write_random_thinker(path, args.layers, 0, "cuda")
        print(f"checkpoint: {time.time() - t0:.0f} s", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 150000, (64,), generator=g).tolist() for _ in range(max(batches))]
    reference, rows = {}, []
    for arm in args.arms.split(","):
        llm = LLM(path, device="cuda", max_num_seqs=max(batches), max_model_len=64 + args.long + 16,
                  cuda_graphs=arm == "graphs")  # fmt: skip
        for b in batches:
            ps = prompts[:b]
            sp = lambda n, b=b: [SamplingParams(max_tokens=n, ignore_eos=True, seed=i) for i in range(b)]  # noqa: E731
            timed(llm, ps, sp(args.short))  # warm-up: kernels, graphs
            t_short, _ = timed(llm, ps, sp(args.short))
            t_long, outs = timed(llm, ps, sp(args.long))
            ms = 1e3 * (t_long - t_short) / (args.long - args.short)
            key = (b,)
            if key not in reference:
                reference[key] = outs
            same = all(
                a.token_ids == o.token_ids and torch.equal(a.logprobs, o.logprobs)
                for a, o in zip(reference[key], outs, strict=True)
            )
            rows.append((arm, b, ms, same))
            print(f"{arm:7s} batch {b:3d}: {ms:7.2f} ms/decode step  bitwise equal to first arm: {same}",
                  flush=True)  # fmt: skip
        del llm
        torch.cuda.empty_cache()
    print("| arm | batch | decode ms/step | same bits as first arm |\n|---|---:|---:|---|")
    for arm, b, ms, same in rows:
        print(f"| {arm} | {b} | {ms:.2f} | {same} |")


if __name__ == "__main__":
    main()
