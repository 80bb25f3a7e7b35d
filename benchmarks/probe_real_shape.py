"""The parity probe at the Qwen3-30B-A3B shape with random bf16 weights (CUDA).

    python benchmarks/probe_real_shape.py --layers 4 --tokens 1000 --out probe.json

Writes a random checkpoint (fused experts layout) through samebits' own saver,
then runs `samebits.verify.run` on it: rollout seq0 alone and 4 concurrent
requests (prompts 10/16/16/24), trainer one at a time and packed-4, and the
grouped_mm / sdpa negative controls. `--logprob-formula trl` (or verl, ...): the engine and
the trainer on that framework's line, the control a neighbouring line.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def write_random_checkpoint(path: Path, layers: int, seed: int) -> Path:
    from samebits.bench import write_random_checkpoint as write

    return write(path, layers, seed)  # shard by shard: 48 layers are 61 GB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--logprob-formula",
        default="log_softmax",
        help="the line the engine reports and the trainer recomputes (docs/logprobs.md); other "
        "than log_softmax, the control is the trainer on a neighbouring line",
    )
    p.add_argument("--dir", default="/dev/shm/samebits-probe")
    p.add_argument("--out", default=None)
    p.add_argument("--reuse", action="store_true", help="use the checkpoint already in --dir")
    p.add_argument(
        "--composite-norms", action="store_true", help="experiment: the exact profile's norms unfused"
    )
    args = p.parse_args()
    from samebits import verify

    t0 = time.time()
    if args.composite_norms:
        from samebits.numerics import composite, registry

        registry.TABLE["rms_norm"]["cuda"]["exact"] = composite.rms_norm  # the table is the one switch
        registry.TABLE["add_rms_norm"]["cuda"]["exact"] = composite.add_rms_norm
    reuse = args.reuse and (Path(args.dir) / "config.json").is_file()
    path = Path(args.dir) if reuse else write_random_checkpoint(Path(args.dir), args.layers, args.seed)
    print(f"checkpoint: {args.layers} layers at {path} in {time.time() - t0:.0f} s", flush=True)
    t0 = time.time()
    results = verify.run(
        model=path,
        device="cuda",
        tokens=args.tokens,
        seed=args.seed,
        temperature=args.temperature,
        logprob_formula=args.logprob_formula,
    )
    print(f"probe: {time.time() - t0:.0f} s", flush=True)
    verify.print_table(results)
    print("PASS" if verify.passed(results) else "FAIL")
    if args.out:
        verify.write_json(results, args.out)
    raise SystemExit(0 if verify.passed(results) else 1)


if __name__ == "__main__":
    main()
