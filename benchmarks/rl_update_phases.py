"""Where one RL update's time goes, per arm: forwards, backwards, loss, clipping, optimizer.

    python benchmarks/rl_update_phases.py --model /dev/shm/q48 --arm on-policy   # CUDA
    python benchmarks/rl_update_phases.py --arm on-policy --steps 2             # tiny model, CPU

Runs `--steps` steps of one arm of `samebits.rl.arms` (run each arm in its own process: the
`batch_invariant()` overrides, once registered, stay for the process) with the shape of
`benchmarks/rl_step.py`'s docs/rl.md command (4 prompts x 4, 128 tokens, experts frozen),
and times, with a device sync around each, every call of: the loop's packed forward (with and
without grad), `Tensor.backward`, the loss, `clip_grad_norm_`, the optimizer step and the
old-log-prob comparison. The syncs take away what host and device overlap, so the parts add
up to more than `time_update_s` on a host-bound step; they say which part grows, not the total.

It also counts the calls of each op that `batch_invariant()` overrides made *outside* the
context during the update (the backward, the optimizer, clipping): once registered, such a
call crosses the overrides' Python wrapper on its way to the stock kernel (on CUDA the
backward runs on autograd's device thread, outside the context), which the stock arm's process
never registers. With `--per-site` they are listed by the Python frame that called them.

`--node-times`: also the host time (no sync) spent inside each of samebits' backward nodes
during the update (the trainer's linears, norms, routers, attention and experts), per kind.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import json
import statistics
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

DIGEST = (
    "model.layers.0.self_attn.q_proj.weight",
    "model.norm.weight",
)


def _count_outside(counts: collections.Counter, per_site: bool, active: list[bool]) -> None:
    """Wrap every override registered from now on so that a call outside the context, while
    `active[0]`, is counted."""
    from samebits.numerics import batch_invariant as bi
    from samebits.numerics import scope

    if bi.installed():
        raise RuntimeError("the batch_invariant() overrides are already registered in this process: run fresh")
    make = bi._override

    def counting(name, device, impl):
        kernel = make(name, device, impl)

        def counted(keyset, *args, **kwargs):
            if active[0] and not scope.invariant_depth():
                site = ""
                if per_site:
                    frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
                    site = " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:]))
                counts[(name, site)] += 1
            return kernel(keyset, *args, **kwargs)

        return counted

    bi._override = counting


def _time_backward_nodes(seconds: collections.Counter, calls: collections.Counter) -> None:
    """Wrap the backward of each of samebits' trainer autograd nodes with a host timer."""
    from samebits.model import attention
    from samebits.numerics import registry
    from samebits.trainer import forwards

    def wrap(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[name] += time.perf_counter() - t0
                calls[name] += 1

        return run

    nodes = [forwards._Linear, forwards._RMSNorm, forwards._Router, attention._PackedAttention]
    if importlib.util.find_spec("samebits.trainer.attention_forward"):  # not in older checkouts
        nodes.append(importlib.import_module("samebits.trainer.attention_forward")._AttentionBlock)
    for cls in nodes:
        cls.backward = staticmethod(wrap(cls.__name__, cls.backward))
    for by_profile in registry.TABLE["experts_backward"].values():
        for profile, fn in by_profile.items():
            by_profile[profile] = wrap("experts", fn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the tiny model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--arm", default="on-policy", help="one of samebits.rl.arms.ARMS")
    p.add_argument("--steps", type=int, default=4, help="steps; the first is listed but not summarised")
    p.add_argument("--per-site", action="store_true", help="count override crossings by calling frame")
    p.add_argument("--node-times", action="store_true", help="host time inside each kind of backward node")
    p.add_argument("--out", default=None, help="write the per-step rows as JSON")
    args = p.parse_args()
    from samebits.rl import RLConfig, RLLoop, train
    from samebits.rl.arms import ARMS

    if args.arm not in ARMS:
        p.error(f"--arm: one of {list(ARMS)}, got {args.arm!r}")
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the first compiles and captures), got {args.steps}")
    crossings: collections.Counter = collections.Counter()
    counting = [False]
    _count_outside(crossings, args.per_site, counting)  # before the loop's first batch_invariant() entry
    config = RLConfig(
        model=args.model,
        device=args.device,
        steps=args.steps,
        num_prompts=4,
        n=4,
        prompt_len=8,
        max_tokens=128,
        lr=1e-4,
        freeze=("experts",),
        digest_tensors=DIGEST if args.model else ("model.norm.weight",),
    )
    loop = RLLoop(replace(config, **ARMS[args.arm]))
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    seconds: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    node_s: collections.Counter = collections.Counter()
    node_calls: collections.Counter = collections.Counter()
    if args.node_times:
        _time_backward_nodes(node_s, node_calls)

    def timed(name, fn):
        def run(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            seconds[name] += time.perf_counter() - t0
            calls[name] += 1
            return out

        return run

    forward = loop.forward
    with_grad, no_grad = timed("forward (grad)", forward), timed("forward (no grad)", forward)
    loop.forward = lambda micro, seqs, plens, grad: (with_grad if grad else no_grad)(micro, seqs, plens, grad)
    loop.optimizer.step = timed("optimizer step", loop.optimizer.step)
    patched = [
        (torch.Tensor, "backward", timed("backward", torch.Tensor.backward)),
        (torch.nn.utils, "clip_grad_norm_", timed("clip_grad_norm_", torch.nn.utils.clip_grad_norm_)),
        (train, "compare", timed("compare", train.compare)),
    ]
    update = train.update_policy

    def update_counted(*a, **k):
        crossings.clear()
        counting[0] = True
        try:
            return update(*a, **k)
        finally:
            counting[0] = False

    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patched]
    for obj, name, fn in patched:
        setattr(obj, name, fn)
    losses = dict(train.LOSSES)
    for name, fn in losses.items():
        train.LOSSES[name] = timed("loss", fn)
    train.update_policy = update_counted
    rows = []
    try:
        for _ in range(args.steps):
            for c in (seconds, calls, node_s, node_calls):
                c.clear()
            metrics = loop.step()
            row = {
                "step": metrics["step"],
                "update_s": metrics["time_update_s"],
                "recompute_s": metrics["time_recompute_s"],
                "parts_s": {k: round(v, 4) for k, v in seconds.items()},
                "calls": dict(calls),
                "override_crossings_in_update": {f"{n} {s}".strip(): c for (n, s), c in crossings.items()},
                "backward_nodes_host_s": {k: [round(v, 4), node_calls[k]] for k, v in node_s.items()},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for obj, name, fn in originals:
            setattr(obj, name, fn)
        train.LOSSES.update(losses)
        train.update_policy = update
    later = rows[1:]
    print(f"\n{args.arm}: median over steps 2..{len(rows)} (seconds, synced parts)")
    for part in sorted({k for r in later for k in r["parts_s"]}):
        print(f"  {part:20s} {statistics.median(r['parts_s'].get(part, 0.0) for r in later):8.3f}")
    print(f"  {'update (unsynced)':20s} {statistics.median(r['update_s'] for r in later):8.3f}")
    for node in sorted({k for r in later for k in r["backward_nodes_host_s"]}):
        host = statistics.median(r["backward_nodes_host_s"].get(node, [0.0, 0])[0] for r in later)
        print(f"  backward node {node:14s} {host:8.3f} host s a step")
    total = sum(rows[-1]["override_crossings_in_update"].values())
    print(f"  override crossings outside the context in the last update: {total}")
    if args.out:
        Path(args.out).write_text(json.dumps({"arm": args.arm, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
