"""What exactness costs the RL loop: `samebits rl` steps, on-policy arm vs stock arm, one run.

    python benchmarks/rl_step.py --layers 48 --dir /dev/shm/q48 --freeze experts --out rl_step.json   # CUDA
    python benchmarks/rl_step.py --steps 3                                       # tiny model, CPU

Arms: `on-policy`, `shared` and `stock`, as `samebits.rl.arms` describes them (each a fresh
`RLLoop` on the same checkpoint, prompts, seeds and settings).

Prints each arm's per-step metrics and one table of the median time per phase over the
steps after the first (the first compiles Triton kernels and captures CUDA graphs).
`--rounds N` runs every arm N times, in the order A B, B A, A B, ... (a drift over the run
weighs on both arms alike), and prints the on-policy / stock ratio of each round beside the
pooled one: the spread between rounds is the measurement's own.
`--warmup-steps` (default 2) first runs the first arm that many steps and throws the run away:
on the H200 the first arm's process after a 48-layer checkpoint was written ran ~0.5 s a step
slower than the same arm run later, whichever arm came first (0 turns it off).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from samebits.rl.arms import ARMS, print_summary, run_arms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: --layers random, or tiny on CPU)")
    p.add_argument("--layers", type=int, default=0, help="write a random Qwen3-30B-A3B-shaped checkpoint")
    p.add_argument("--dir", default="/dev/shm/samebits-rl-step", help="where --layers writes it")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--arms", default="on-policy,stock", help=f"comma-separated, of {list(ARMS)}")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--freeze", default="", help="comma-separated groups, e.g. experts")
    p.add_argument(
        "--digest",
        default=None,
        help="comma-separated names to digest each step (default: every parameter)",
    )
    p.add_argument(
        "--digest-kind",
        default="fast",
        choices=["fast", "sha256"],
        help="fast: a checksum on the GPU (default); sha256: on the host, slow at scale",
    )
    p.add_argument("--warmup-steps", type=int, default=2, help="steps of a thrown-away first run (0: none)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every arm this many times, the order reversed every other round (prints each round's ratio)",
    )
    p.add_argument("--out", default=None, help="write every arm's per-step metrics as JSON")
    args = p.parse_args()
    if args.warmup_steps < 0:
        p.error(f"--warmup-steps must be >= 0 (0: no warm-up run), got {args.warmup_steps}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    from samebits.rl import RLConfig

    model = args.model
    if args.layers:
        from samebits.bench import write_random_checkpoint

        t0 = time.perf_counter()
        model = str(write_random_checkpoint(Path(args.dir), args.layers, seed=0))
        torch.cuda.empty_cache()  # the arms' processes need the memory
        print(f"checkpoint: {args.layers} layers at {model} in {time.perf_counter() - t0:.0f} s", flush=True)
    config = RLConfig(
        model=model,
        device=args.device,
        steps=args.steps,
        num_prompts=args.prompts,
        n=args.n,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        lr=args.lr,
        freeze=tuple(f for f in args.freeze.split(",") if f),
        digest_tensors=tuple(args.digest.split(",")) if args.digest else None,
        digest_kind=args.digest_kind,
    )
    results = run_arms(config, arms, warmup_steps=args.warmup_steps, rounds=args.rounds)  # a fresh process each
    print_summary(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
