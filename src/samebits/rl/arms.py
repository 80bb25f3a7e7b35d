"""What exactness costs the RL loop: `RLLoop` steps of the on-policy arm vs the stock arm.

Used by `benchmarks/rl_step.py` (every phase, every arm) and by `samebits bench --rl`
(`bench_ratio`: the step ratio in the bench table). Arms, each a fresh `RLLoop` on the same checkpoint,
prompts, seeds and settings:
- `on-policy`: the engine's exact profile; the trainer's transformers model with samebits
  experts and attention; recompute and update forwards under `batch_invariant()`.
- `shared`: the on-policy arm with the engine on the trainer's own tensors (no sync copy).
- `stock`: the engine's fast profile (cuBLAS, stock reductions); the trainer with transformers'
  `grouped_mm` experts and `sdpa` attention; recompute and update forwards on stock kernels.
  This is the loop a normal engine + trainer would run: its mismatch counts are nonzero.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

ARMS = {
    "on-policy": {},
    "shared": {"share_weights": True},  # on-policy, one copy of the model (--share-weights)
    "stock": dict(
        engine_numerics="fast",
        trainer_experts="grouped_mm",
        trainer_attention="sdpa",
        recompute_kernels="stock",
        update_kernels="stock",
    ),
}
PHASES = ("rollout", "reward", "recompute", "update", "sync", "digest", "step")
# `samebits bench --rl`: the shape (8 prompts x 4 samples, 128 new tokens, experts frozen,
# as `benchmarks/rl_step.py --freeze experts`); two digested tensors, not all (hashing every
# parameter of a 30B model each step would swamp the step it prices)
RL_SHAPE = dict(num_prompts=8, n=4, max_tokens=128, lr=1e-4, freeze=("experts",))
RL_DIGEST = ("model.norm.weight", "model.layers.0.self_attn.q_proj.weight")


def run_arm(config, log=print) -> list[dict]:
    """`config.steps` steps of a fresh `RLLoop(config)`; one metrics dict per step."""
    from samebits.rl import RLLoop

    t0 = time.perf_counter()
    loop = RLLoop(config)
    log(f"  loaded engine + trainer in {time.perf_counter() - t0:.0f} s")
    rows = []
    for _ in range(config.steps):
        rows.append(loop.step())
        r = rows[-1]
        log(
            f"  step {r['step']}: rollout {count([r], 'rollout')} old {count([r], 'old')}"
            f" digests {r['digests_checked'] - r['digest_mismatch_count']}/{r['digests_checked']}"
            f" grad_norm {r['grad_norm']:.3g} reward {r['reward_mean']:.3f} step {r['time_step_s']:.2f} s"
        )
    return rows


def _flushed(text: str) -> None:
    print(text, flush=True)


def run_arms(
    config, arms, spawn: bool = True, log=_flushed, warmup_steps: int = 0, rounds: int = 1
) -> dict[str, list[dict]]:
    """Each arm's per-step metrics. With `spawn`, each arm runs in a fresh process: both
    start cold, and all of an arm's device memory is freed before the next one loads.

    `warmup_steps`: first a run of the first arm, that many steps, thrown away. On the H200
    the first arm's process after a 48-layer checkpoint was written ran ~0.5 s a step slower
    than the same arm later, whichever arm it was (docs/performance.md, 2026-12-04), so
    without it the first arm's ratio carries the machine's settling.

    `rounds`: run every arm that many times, the order reversed every other round (A B, B A,
    A B, ...), so that a drift over the run weighs on both arms alike. An arm's rows are its
    runs' rows in order, each tagged with its `round`; `medians` skips each run's first step."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"arms: unknown {unknown}; choose from {list(ARMS)}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0 (0: no warm-up run), got {warmup_steps}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if warmup_steps:
        log(f"warm-up run of {arms[0]}, {warmup_steps} steps (thrown away):")
        _run_in(replace(config, steps=warmup_steps, **ARMS[arms[0]]), spawn, log)
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            log(f"arm {arm}:" if rounds == 1 else f"arm {arm}, round {r + 1} of {rounds}:")
            rows = _run_in(replace(config, **ARMS[arm]), spawn, log)
            results[arm] += [row | {"round": r} for row in rows]
    return results


def _run_in(config, spawn: bool, log) -> list[dict]:
    if not spawn:
        return run_arm(config, log)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_arm, config, _flushed).result()


def medians(rows: list[dict]) -> dict[str, float]:
    """Median seconds per phase over the steps after each run's first (which compiles kernels
    and captures graphs); all steps if no run has more than one."""
    timed = [r for i, r in enumerate(rows) if i and r.get("round", 0) == rows[i - 1].get("round", 0)]
    timed = timed or rows
    return {p: statistics.median(r[f"time_{p}_s"] for r in timed) for p in PHASES}


def round_ratios(results: dict[str, list[dict]]) -> list[float]:
    """The on-policy / stock ratio of median step seconds within each round."""
    rounds = sorted({r.get("round", 0) for r in results["on-policy"]})
    out = []
    for k in rounds:
        on, stock = ([r for r in results[a] if r.get("round", 0) == k] for a in ("on-policy", "stock"))
        out.append(medians(on)["step"] / medians(stock)["step"])
    return out


def step_ratio(results: dict[str, list[dict]]) -> dict:
    """{'on_policy_s', 'stock_s', 'ratio', 'round_ratios'}: median step seconds of both arms,
    their ratio, and the ratio within each round (`round_ratios`)."""
    on, stock = medians(results["on-policy"])["step"], medians(results["stock"])["step"]
    return {"on_policy_s": on, "stock_s": stock, "ratio": on / stock, "round_ratios": round_ratios(results)}


def bench_ratio(
    model, steps: int, device: str = "cuda", spawn: bool = True, warmup_steps: int = 1, **shape
) -> dict:
    """The RL step ratio `samebits bench --rl` reports: `steps` steps of the on-policy and the
    stock arm at RL_SHAPE (keys of `shape` override it), median step time after the first,
    after a thrown-away warm-up run of `warmup_steps` (`run_arms`).
    `step_ratio`'s keys plus `steps` and `shape` ("prompts x n (prompt -> new tokens)")."""
    from samebits.rl import RLConfig

    fields = RL_SHAPE | {"digest_tensors": RL_DIGEST} | shape
    c = RLConfig(model=str(model), device=device, steps=steps, **fields)
    shape_text = f"{c.num_prompts} x {c.n} ({c.prompt_len} -> {c.max_tokens})"
    results = run_arms(c, ("on-policy", "stock"), spawn=spawn, warmup_steps=warmup_steps)
    return step_ratio(results) | {"steps": steps, "shape": shape_text}


def count(rows: list[dict], kind: str) -> str:
    """'mismatches/tokens' of the rollout or old-log-prob comparison, summed over rows."""
    return "/".join(str(sum(r[f"{kind}_logprobs_{k}"] for r in rows)) for k in ("mismatch_count", "tokens"))


def print_summary(results: dict[str, list[dict]]) -> None:
    """One table: median seconds per phase of every arm, the step as a ratio to stock's."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="RL step: median seconds per phase (steps after each run's first)")
    table.add_column("arm")
    for p in PHASES:
        table.add_column(p, justify="right")
    table.add_column("mismatches rollout / old", justify="right")
    base = medians(results["stock"])["step"] if "stock" in results else None
    for arm, rows in results.items():
        med = medians(rows)
        step = f"{med['step']:.3f}" + (f" ({med['step'] / base:.2f}x)" if base else "")
        table.add_row(
            arm,
            *[f"{med[p]:.3f}" for p in PHASES[:-1]],
            step,
            f"{count(rows, 'rollout')} / {count(rows, 'old')}",
        )
    Console(width=160).print(table)
    if "on-policy" in results and "stock" in results and len({r.get("round", 0) for r in results["stock"]}) > 1:
        print("on-policy / stock by round: " + ", ".join(f"{x:.3f}x" for x in round_ratios(results)))
