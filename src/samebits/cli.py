"""`samebits` command line."""

from __future__ import annotations

import argparse
import sys


def _verify(args) -> int:
    from samebits import verify

    lens = tuple(int(x) for x in args.prompt_lens.split(","))
    results = verify.run(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        tokens=args.tokens,
        seed=args.seed,
        prompt_lens=lens,
    )
    verify.print_table(results)
    if args.json:
        verify.write_json(results, args.json)
    ok = verify.passed(results)
    print("PASS: every exact arm bitwise equal, every negative control differs" if ok else "FAIL")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="samebits", description="Bitwise on-policy rollouts for MoE RL.")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser(
        "verify",
        help="probe rollout log-probs against the transformers trainer",
        description="Rollout seq0 alone and 4 concurrent requests, recompute with the "
        "transformers trainer one at a time and packed, compare bitwise; negative "
        "controls must differ. Exit 0 only when all of that holds.",
    )
    v.add_argument("--model", default=None, help="HF checkpoint dir (default: built-in tiny model)")
    v.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    v.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    v.add_argument("--tokens", type=int, default=32, help="tokens generated per request (default 32)")
    v.add_argument("--seed", type=int, default=0, help="seed for the tiny model, prompts and sampling")
    v.add_argument("--prompt-lens", default="10,16,16,24", help="comma-separated prompt lengths")
    v.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    v.set_defaults(fn=_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
