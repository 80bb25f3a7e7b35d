"""TRL's own GRPOTrainer driving samebits through `samebits.integrations.trl`, step by step:
each step's mismatch count (TRL's recompute against the rollout's log-probs) and wall time.

    python benchmarks/trl_grpo_steps.py --steps 3                                   # tiny, CPU
    python benchmarks/trl_grpo_steps.py --layers 48 --dir /dev/shm/q48 --steps 3 \\
        --freeze experts --out trl_grpo.json                                        # CUDA

The engine is an in-process `samebits.LLM` (weights pushed with `update_weights` at every
step, `steps_per_generation=1`: TRL's default cadence, so every step is a rollout, a push and
one optimizer step). At the 48-layer shape the trainer's bf16 model and the engine's copy are
61 GB each, so it needs an H200, or `--share-weights` (the engine on the trainer's own tensors,
`LLM(weights=...)`: a push forgets the prefix cache, no copy) on an 80 GB card; `--freeze
experts` keeps the gradients small and the optimizer is SGD (no state). Per step it prints
TRL's `sampling/sampling_logp_difference/max` and the integration's
`samebits/logprob_mismatch_count` and `samebits/logprob_tokens`, which the integration computes
from TRL's own recompute (docs/integrations.md, "Metrics").
The first step compiles Triton kernels and captures CUDA graphs: its time is not the rate.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def _dataset(Dataset, prompts):
    """The prompts as a datasets.Dataset with a fixed fingerprint: `from_dict` hashes the table
    with dill, which fails on the device image's Python 3.12 with pyarrow 24 (PicklingError on
    pyarrow's MonthDayNano type)."""
    from datasets.table import InMemoryTable

    return Dataset(InMemoryTable.from_pydict({"prompt": prompts}), fingerprint="trl-grpo-steps")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: --layers random, or tiny)")
    p.add_argument("--layers", type=int, default=0, help="write a random Qwen3-30B-A3B-shaped checkpoint")
    p.add_argument("--dir", default="/dev/shm/samebits-trl", help="where --layers writes it")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="prompts a step")
    p.add_argument("--n", type=int, default=4, help="completions a prompt (TRL's num_generations)")
    p.add_argument("--max-tokens", type=int, default=64, help="TRL's max_completion_length")
    p.add_argument("--freeze", default="", help="comma-separated groups to freeze (experts, router, ...)")
    p.add_argument("--share-weights", action="store_true",
                   help="the engine runs on the trainer's own tensors (LLM(weights=...)): one copy of the "
                        "model, so the 48-layer shape fits an 80 GB card")  # fmt: skip
    p.add_argument("--out", default=None, help="write the per-step results as JSON")
    args = p.parse_args()

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import samebits
    from samebits import trainer as sb
    from samebits.bench import write_random_checkpoint
    from samebits.integrations import trl as sbtrl
    from samebits.model.tiny_tokenizer import add_tiny_tokenizer, tiny_checkpoint_with_tokenizer
    from samebits.rl.config import FREEZE_GROUPS
    from samebits.rl.train import freeze

    if args.model:
        path = Path(args.model)
    elif args.layers:
        path = Path(args.dir)
        if not (path / "config.json").is_file():
            write_random_checkpoint(path, args.layers, seed=0)
        if not (path / "tokenizer.json").is_file():  # TRL tokenizes the prompts: the tiny byte-level one
            add_tiny_tokenizer(path)  # (its 384 ids cover the prompts; other ids decode to nothing)
    else:
        path = tiny_checkpoint_with_tokenizer(seed=0)
    model = sb.load_hf_model(path, device=args.device)
    patterns = tuple(FREEZE_GROUPS.get(f, f) for f in args.freeze.split(",") if f)
    if patterns:
        freeze(model, patterns)
    seqs = args.prompts * args.n
    shared = {"weights": model.named_parameters(remove_duplicate=False)} if args.share_weights else {}
    llm = samebits.LLM(
        path, device=args.device, max_num_seqs=seqs, max_model_len=64 + args.max_tokens, **shared
    )
    rollout = sbtrl.rollout_func(llm, seed=1, check_digests=args.layers == 0)  # digests hash 61 GB a push
    words = "the cat sat on a mat while it rained and we read old books by the fire".split()
    prompts = [" ".join(words[i % 7 : i % 7 + 3 + i % 5]) for i in range(64)]  # of different lengths
    times: list[float] = []

    class Timed(GRPOTrainer):
        def training_step(self, *a, **k):
            t0 = time.perf_counter()
            out = super().training_step(*a, **k)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            return out

    config = GRPOConfig(
        output_dir=str(Path(args.dir) / "trl-out"),
        use_cpu=args.device == "cpu",
        per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n,
        steps_per_generation=1,
        max_completion_length=args.max_tokens,
        max_steps=args.steps,
        learning_rate=1e-4,
        optim="sgd",
        temperature=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    trainer = Timed(
        model=model,
        reward_funcs=lambda completion_ids, **kw: [float(sum(t % 2 for t in ids)) for ids in completion_ids],
        args=config,
        train_dataset=_dataset(Dataset, prompts),
        rollout_func=rollout,
    )
    sbtrl.exact_logprobs(trainer)
    trainer.train()

    logged = [h for h in trainer.state.log_history if "samebits/logprob_mismatch_count" in h]
    rows = [
        {
            "step": i,
            "seconds": round(t, 3),
            "mismatches": int(h["samebits/logprob_mismatch_count"]),
            "tokens": int(h["samebits/logprob_tokens"]),
            "sampling_logp_difference_max": h["sampling/sampling_logp_difference/max"],
        }
        for i, (t, h) in enumerate(zip(times, logged, strict=True))
    ]
    for r in rows:
        print(r)
    doc = {
        "model": str(path),
        "device": args.device,
        "shared_weights": args.share_weights,
        "syncs": rollout.syncs,
    }
    doc["steps"] = rows
    if torch.cuda.is_available():
        doc["card"] = torch.cuda.get_device_name()
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2))
    ok = bool(rows) and all(r["mismatches"] == 0 and r["tokens"] > 0 for r in rows)
    print("PASS: 0 mismatches at every step" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
