"""`samebits rl`: the closed RL loop from the command line (options, exit status, the table)."""

from __future__ import annotations

import os
import sys

from samebits import rl
from samebits.requests.sampling_params import LOGPROB_FORMULAS


def run(args) -> int:
    """`samebits rl`: the loop of `args`; 0 only when every step has 0 mismatches and equal digests."""
    from samebits.rl import report

    try:
        cfg = config_from_args(args)
    except ValueError as e:  # the config or option names the field and the allowed values
        print(f"samebits rl: {e}", file=sys.stderr)
        return 2
    if args.api_key:  # read by rl.remote (and a spawned server) from the environment, not the config
        os.environ["VLLM_API_KEY"] = args.api_key
    if args.distributed:
        return _rl_distributed(cfg, args)
    every = rl.CHECKPOINT_EVERY if args.checkpoint_every is None else args.checkpoint_every
    try:  # rl.run checks every option and the resumed checkpoint before any work
        rows = rl.run(
            cfg,
            live=not args.no_live,
            resume=args.resume,
            checkpoint_every=every,
            overwrite=args.overwrite,
            allow_changes=_allowed(args),
        )
    except rl.RewardError as e:  # the step stopped before any update: nothing half-applied
        print(f"samebits rl: {e}; {_resume_hint(cfg)}", file=sys.stderr)
        return 1
    except rl.RunStopped as e:
        print(f"samebits rl: {e}; {_resume_hint(cfg)}", file=sys.stderr)
        return 128 + e.signum
    except ValueError as e:  # refused setup: a freeze or digest name that matches nothing, ...
        print(f"samebits rl: {e}", file=sys.stderr)
        return 2
    report.print_table(rows, "samebits rl: per-step metrics (mismatches: torch.equal per token)")
    rewards = ", ".join(f"{r['reward_mean']:.3f}" for r in rows)
    print(f"reward mean per step: {rewards}")
    print(f"metrics: {cfg.out_dir}/metrics.jsonl, plot: {cfg.out_dir}/metrics.png")
    if rl.passed(rows):
        print("PASS: 0 rollout and 0 old-log-prob mismatches, engine and trainer digests equal, every step")
        return 0
    bad = [r["step"] for r in rows if not rl.passed([r])]
    print(f"FAIL: mismatching log-probs or weight digests at steps {bad}")
    return 1


def _allowed(args) -> tuple[str, ...]:
    return tuple(f for f in args.allow_change.split(",") if f)


def _resume_hint(cfg) -> str:
    return f"resume with --resume {cfg.out_dir}/checkpoint.pt" if cfg.out_dir else "no --out: nothing was kept"


def _rl_distributed(cfg, args) -> int:
    """`samebits rl --distributed` under torchrun: every rank runs this; rank 0 prints."""
    from samebits.rl import distributed, report

    if args.resume or args.checkpoint_every is not None or args.allow_change:
        print(
            "samebits rl: --resume / --checkpoint-every / --allow-change are not supported with --distributed",
            file=sys.stderr,
        )
        return 2
    try:
        rows = distributed.run(cfg, overwrite=args.overwrite)
    except ValueError as e:  # the same refused setup on every rank
        print(f"samebits rl: {e}", file=sys.stderr)
        return 2
    ok = distributed.passed(rows)
    if int(os.environ.get("RANK", "0")) == 0:
        title = f"samebits rl --distributed: {rows[0]['world_size']} ranks, totals over ranks"
        report.print_table(rows, title)
        print(f"metrics: {cfg.out_dir}/metrics.jsonl (per-rank counters and digests: rank_* fields)")
        print("no checkpoint: not supported with --distributed yet")
        print(
            "PASS: 0/0 mismatches on every rank, every replica's digests equal the trainer's" if ok else "FAIL"
        )
    return 0 if ok else 1


def config_from_args(args) -> rl.RLConfig:
    """The `RLConfig` of parsed `samebits rl` arguments (RLConfig checks every field)."""
    return rl.RLConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        algorithm=args.algorithm,
        steps=args.steps,
        num_prompts=args.prompts,
        prompt_len=args.prompt_len,
        n=args.n,
        max_tokens=args.max_tokens,
        force_max_length=args.force_max_length,
        temperature=args.temperature,
        logprob_formula=args.logprob_formula,
        lr=args.lr,
        max_grad_norm=args.max_grad_norm,
        clip_eps=args.clip_eps,
        mini_batches=args.mini_batches,
        micro_batch_tokens=args.micro_batch_tokens,
        freeze=tuple(f for f in args.freeze.split(",") if f),
        reward=args.reward,
        seed=args.seed,
        trainer_experts=args.trainer_experts,
        update_kernels=args.update_kernels,
        engine_numerics=args.engine_numerics,
        trainer_attention=args.trainer_attention,
        recompute_kernels=args.recompute_kernels,
        digest_tensors=None if args.digest == "all" else tuple(args.digest.split(",")),
        digest_kind=args.digest_kind,
        share_weights=args.share_weights,
        server=args.server,
        weight_sync=args.weight_sync,
        out_dir=args.out,
    )


def add_parser(sub) -> None:
    r = sub.add_parser(
        "rl",
        help="closed RL loop (GSPO/GRPO) checking bitwise on-policy log-probs every step",
        description="Each step: rollout with the samebits engine, rewards, trainer recompute of the "
        "old log-probs (packed, under batch_invariant()), bitwise comparison, AdamW update(s), "
        "weight sync into the engine and a weight digest check. Exit 0 only when every step has 0 "
        "mismatches and equal digests. With no arguments: 10 steps on the built-in tiny model, CPU.",
    )
    r.add_argument("--model", default=None, help="HF checkpoint dir (default: built-in tiny model)")
    r.add_argument("--device", default="cpu", help="torch device for engine and trainer (default: cpu)")
    r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    r.add_argument("--algorithm", default="gspo", choices=["gspo", "grpo"], help="default gspo")
    r.add_argument("--steps", type=int, default=10, help="RL steps (default 10)")
    r.add_argument("--prompts", type=int, default=4, help="random prompts per step (default 4)")
    r.add_argument("--prompt-len", type=int, default=8, help="tokens per prompt (default 8)")
    r.add_argument("--n", type=int, default=4, help="responses per prompt, >= 2 (default 4)")
    r.add_argument("--max-tokens", type=int, default=24, help="max response tokens (default 24)")
    r.add_argument(
        "--force-max-length", action="store_true", help="every response exactly --max-tokens (ignore eos)"
    )
    r.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1)")
    r.add_argument(
        "--logprob-formula",
        default="log_softmax",
        choices=LOGPROB_FORMULAS,
        help="the trainer line of the log-probs, on both sides: the engine reports it and the trainer's "
        "recompute and update compute it, so the mismatch counts stay 0 (docs/logprobs.md); default "
        "log_softmax. With --server URL, start that server with the same --logprob-formula",
    )
    r.add_argument("--lr", type=float, default=3e-2, help="AdamW learning rate (default 3e-2)")
    r.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm (default 1)")
    r.add_argument("--clip-eps", type=float, default=0.2, help="ratio clip range 1 +- eps (default 0.2)")
    r.add_argument("--mini-batches", type=int, default=4, help="optimizer steps per rollout batch (default 4)")
    r.add_argument(
        "--micro-batch-tokens", type=int, default=512, help="token budget of one packed forward (default 512)"
    )
    r.add_argument(
        "--freeze",
        default="",
        help="comma-separated parameter groups to freeze (experts, router, attention, embeddings, "
        "lm_head, norms) or name substrings",
    )
    r.add_argument("--reward", default="toy", help="toy (learnable), hash, or module:function (default toy)")
    r.add_argument("--seed", type=int, default=0, help="seed for prompts and sampling (default 0)")
    r.add_argument(
        "--trainer-experts",
        default="samebits",
        choices=["samebits", "grouped_mm", "eager"],
        help="trainer experts implementation; grouped_mm is the negative control (bf16: the rollout "
        "count must be nonzero)",
    )
    r.add_argument(
        "--update-kernels",
        default="batch_invariant",
        choices=["batch_invariant", "stock"],
        help="kernels of the update forward; stock is the negative control of the old-log-prob check",
    )
    r.add_argument(
        "--recompute-kernels",
        default="batch_invariant",
        choices=["batch_invariant", "stock"],
        help="kernels of the old-log-prob recompute; stock is part of the stock baseline",
    )
    r.add_argument(
        "--engine-numerics",
        default="exact",
        choices=["exact", "fast"],
        help="the engine's numerics profile; fast (cuBLAS, stock reductions) is part of the stock baseline",
    )
    r.add_argument(
        "--trainer-attention",
        default="samebits",
        choices=["samebits", "sdpa", "eager"],
        help="trainer attention implementation; sdpa is part of the stock baseline",
    )
    r.add_argument("--digest", default="all", help="'all' or comma-separated parameter names to digest")
    r.add_argument(
        "--digest-kind",
        default="fast",
        choices=["fast", "sha256"],
        help="fast: a 256-bit checksum on the weights' device, no host copy, not cryptographic "
        "(default); sha256: the bytes hashed on the host (minutes for a 30B model)",
    )
    r.add_argument(
        "--share-weights",
        action="store_true",
        help="the engine runs on the trainer's own parameter tensors: one copy of the model on the device",
    )
    r.add_argument(
        "--server",
        default=None,
        metavar="URL|spawn",
        help="the engine is a samebits serve reached only over HTTP and the weight-update group, "
        "as an external framework drives it: its URL, or 'spawn' to start one on 127.0.0.1",
    )
    r.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="with --server: the key sent as 'Authorization: Bearer KEY' (the server's admin key when it "
        "has one: the loop pushes weights); default $VLLM_API_KEY; never written to --out",
    )
    r.add_argument(
        "--weight-sync",
        default="distributed",
        choices=["distributed", "tensor"],
        help="with --server: distributed (the weight-update group, gloo/NCCL; default) or tensor "
        "(CUDA IPC handles: a server on the same GPU)",
    )
    r.add_argument(
        "--out",
        default="runs/rl",
        help="output dir for metrics.jsonl, metrics.png, checkpoint.pt (default runs/rl); a dir that "
        "already holds a run is refused unless --resume or --overwrite",
    )
    r.add_argument(
        "--resume",
        default=None,
        metavar="CKPT",
        help="resume from a checkpoint.pt (plain data only; a changed config is refused, see --allow-change)",
    )
    r.add_argument(
        "--allow-change",
        default="",
        metavar="FIELDS",
        help="comma-separated config fields (e.g. lr,seed) that --resume may change "
        "(--steps, --out and --digest-kind always may)",
    )
    r.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    r.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="checkpoint every K steps (default 10; 0: only at the end); also at the end, on SIGINT/SIGTERM "
        "and after a failing reward",
    )
    r.add_argument("--no-live", action="store_true", help="no live table on stderr")
    r.add_argument(
        "--distributed",
        action="store_true",
        help="one rank per torchrun process: FSDP2 trainer, one rollout replica per rank (docs/distributed.md)",
    )
    r.set_defaults(fn=run)
