"""`samebits` command line: `verify` and `bench` here; `rl` and `serve` parse and run beside their
packages (`rl/cli.py`, `serve/cli.py`)."""

from __future__ import annotations

import argparse
import sys

from samebits import __version__, cli_checks
from samebits.cli_checks import refuse
from samebits.requests.sampling_params import LOGPROB_FORMULAS
from samebits.rl import cli as rl_cli
from samebits.serve import cli as serve_cli


def _verify(args) -> int:
    from samebits import verify

    try:
        results = verify.run(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            tokens=args.tokens,
            seed=args.seed,
            prompt_lens=args.prompt_lens,
            temperature=args.temperature,
            logprob_formula=args.logprob_formula,
        )
    except (ValueError, FileNotFoundError) as e:  # a refused checkpoint or setting, before any rollout
        refuse("samebits verify", str(e))
    verify.print_table(results)
    if args.json:
        verify.write_json(results, args.json)
    ok = verify.passed(results)
    print("PASS: every exact arm bitwise equal, every negative control differs" if ok else "FAIL")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = cli_checks.Parser(prog="samebits", description="Bitwise on-policy rollouts for MoE RL.")
    p.add_argument("--version", action="version", version=f"samebits {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser(
        "verify",
        help="probe rollout log-probs against the transformers trainer",
        description="Rollout seq0 alone and 4 concurrent requests, recompute with the "
        "transformers trainer one at a time and packed, compare bitwise; negative "
        "controls must differ. Exit 0 only when all of that holds.",
    )
    v.add_argument(
        "--model",
        default=None,
        type=cli_checks.model,
        help="HF checkpoint dir, or a hub id in the local HF cache (default: built-in tiny model)",
    )
    v.add_argument("--device", default="cpu", type=cli_checks.device, help="torch device (default: cpu)")
    v.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    v.add_argument(
        "--tokens", type=cli_checks.positive_int, default=32, help="tokens generated per request (default 32)"
    )
    v.add_argument(
        "--seed", type=cli_checks.seed, default=0, help="seed for the tiny model, prompts and sampling"
    )
    v.add_argument(
        "--temperature",
        type=cli_checks.temperature,
        default=1.0,
        help="sampling temperature; the trainer recomputes log_softmax(logits.float() / T) "
        "(0: greedy, log-probs at T = 1; other than 0 and 1 adds a 1/T-rounding control) (default 1.0)",
    )
    v.add_argument(
        "--logprob-formula",
        default="log_softmax",
        choices=LOGPROB_FORMULAS,
        help="the trainer line the engine reports and the trainer recomputes (docs/logprobs.md); "
        "other than log_softmax, the controls are one: the trainer on a neighbouring line "
        "(default log_softmax)",
    )
    v.add_argument(
        "--prompt-lens",
        default=(10, 16, 16, 24),
        type=cli_checks.positive_ints,
        help="comma-separated prompt lengths (default 10,16,16,24)",
    )
    v.add_argument(
        "--json",
        default=None,
        type=cli_checks.writable_file,
        metavar="PATH",
        help="also write the results as JSON (its folder must exist)",
    )
    v.set_defaults(fn=_verify)
    rl_cli.add_parser(sub)
    _add_bench(sub)
    serve_cli.add_parser(sub)
    return p


def _bench(args) -> int:
    from pathlib import Path

    import torch

    from samebits import bench

    arms = tuple(a for a in args.arms.split(",") if a)
    unknown = sorted(set(arms) - set(bench.ARMS))
    if unknown or not (arms or args.rl):  # --arms '' --rl: the RL step alone
        refuse("samebits bench", f"--arms takes any of {','.join(bench.ARMS)}, got {args.arms!r}")
    batches, hf_batches = args.batches, args.hf_batches
    if not torch.cuda.is_available():  # before the random checkpoint is written
        refuse("samebits bench", "bench measures CUDA decode steps and no CUDA device is visible")
    model = args.model
    if model is None:
        print(f"writing a random Qwen3-30B-A3B-shaped checkpoint, {args.layers} layers, to {args.dir}")
        model = bench.write_random_checkpoint(Path(args.dir), args.layers, seed=0)
        bench.free_memory()  # the generator's blocks, cached by this process
    rollout = (args.num_prompts, args.input_len, args.output_len) if args.num_prompts else None
    out = Path(args.out)
    rl_step = None
    if args.rl:
        # First, while this process holds no GPU memory: each arm runs in its own process with
        # the engine and the trainer's model side by side (~125 GiB at 48 layers on the H200),
        # and after the arms below this process keeps cached blocks it cannot hand back (an
        # RL run after them was refused 768 MiB there).
        from samebits.rl import arms as rl_arms

        rl_step = rl_arms.bench_ratio(model, args.rl_steps)
        print(f"RL step: on-policy {rl_step['ratio']:.2f}x stock")

    def partial(result) -> None:  # what is measured so far, marked incomplete
        result.rl_step = rl_step
        result.meta["complete"] = False
        bench.write_outputs(result, out, plot=False)

    print(f"results so far go to {out / 'bench.json'} as each arm finishes")
    result = bench.run(
        model,
        batches=batches,
        context=args.context,
        arms=arms,
        hf_batches=hf_batches,
        steps=args.steps,
        generate_steps=args.generate_steps,
        rollout=rollout,
        async_scheduling=args.async_scheduling,
        max_num_batched_tokens=args.max_num_batched_tokens,
        on_progress=partial,
    )
    result.rl_step = rl_step
    result.meta["layers"] = args.layers if args.model is None else None
    result.meta["complete"] = True
    bench.print_table(result)
    written = bench.write_outputs(result, out)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _add_bench(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="what users see: decode, prefill and a rollout through generate, exact vs fast; "
        "vs transformers generate, the trainer and the RL step (CUDA)",
        description="For the exact and fast profiles at each batch size B (B sequences of --context "
        "tokens): decode ms per output token (the median step in which all B rows decode) and prefill "
        "tok/s through LLM.generate, the "
        "engine step (batch assembly, forward, CUDA graphs, sampling) and its CUDA-graph replay "
        "alone, against the memory floor (bytes a step reads over the measured copy bandwidth); "
        "and a rollout of --num-prompts x (--input-len -> --output-len) tokens through generate as "
        "total output tok/s. Also transformers generate's decode step, the trainer's packed "
        "forward+backward of 4 x 1024 tokens with samebits kernels vs stock transformers (experts "
        "frozen), and with --rl the RL step of the on-policy loop vs the stock loop. Prints one "
        "table; writes bench.json, bench.csv and bench.png (bench.json and bench.csv also after each "
        "arm, marked complete: false until the end, so a run stopped part way keeps what it measured).",
    )
    b.add_argument(
        "--model",
        default=None,
        type=cli_checks.model,
        help="HF checkpoint dir or cached hub id (default: a random Qwen3-30B-A3B shape)",
    )
    b.add_argument(
        "--layers",
        type=cli_checks.positive_int,
        default=48,
        help="layers of the random checkpoint (default 48)",
    )
    b.add_argument(
        "--dir",
        default="/dev/shm/samebits-bench",
        type=cli_checks.writable_dir,
        help="where the random checkpoint is written",
    )
    b.add_argument(
        "--batches",
        default=(1, 8, 32, 64, 256),
        type=cli_checks.positive_ints,
        help="comma-separated batch sizes",
    )
    b.add_argument(
        "--hf-batches",
        default=None,
        type=cli_checks.positive_ints,
        help="batch sizes for transformers generate (default: --batches)",
    )
    b.add_argument(
        "--context", type=cli_checks.positive_int, default=1024, help="tokens of KV per sequence (default 1024)"
    )
    b.add_argument(
        "--arms",
        default="exact,fast,hf,trainer",
        help="any of exact,fast,hf,trainer (may be empty with --rl)",
    )
    b.add_argument(
        "--steps",
        type=cli_checks.positive_int,
        default=20,
        help="timed engine steps (runner, not generate) per point (default 20)",
    )
    _add_user_flags(b)
    b.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engine's async scheduling (default: the engine's, on for CUDA); run once with "
        "each to price the host loop",
    )
    b.add_argument(
        "--max-num-batched-tokens",
        type=cli_checks.positive_int,
        default=None,
        help="the engine's token budget a step (default: the engine's, max(max_model_len, 8192) on "
        "CUDA); run with several to pick the prefill's",
    )
    b.add_argument(
        "--out", default="bench-out", type=cli_checks.writable_dir, help="output folder (default bench-out)"
    )
    b.set_defaults(fn=_bench)


def _add_user_flags(b) -> None:
    """`samebits bench`'s measurements through generate, and the RL step."""
    b.add_argument(
        "--generate-steps",
        type=cli_checks.non_negative_int,
        default=64,
        help="decode steps timed through generate per point, after the prefill phase; raised to the "
        "prefill phase's step count where that is larger (default 64; 0 skips decode and prefill "
        "through generate)",
    )
    b.add_argument(
        "--num-prompts",
        type=cli_checks.non_negative_int,
        default=256,
        help="rollout requests, per engine arm (default 256; 0 skips the rollout)",
    )
    b.add_argument(
        "--input-len", type=cli_checks.positive_int, default=1024, help="rollout prompt tokens (default 1024)"
    )
    b.add_argument(
        "--output-len",
        type=cli_checks.positive_int,
        default=1024,
        help="rollout new tokens per request (default 1024)",
    )
    b.add_argument(
        "--rl",
        action="store_true",
        help="also time RL steps of the on-policy loop vs the stock loop "
        "(8 prompts x 4, 128 tokens, experts frozen; slow)",
    )
    b.add_argument(
        "--rl-steps",
        type=cli_checks.positive_int,
        default=3,
        help="RL steps per loop with --rl; the first is not timed (default 3)",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
