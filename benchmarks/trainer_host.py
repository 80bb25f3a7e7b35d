"""The trainer's host time per micro-batch with its CUDA kernels stubbed out: no device needed.

    PYTHONPATH=/path/to/triton python benchmarks/trainer_host.py     # Triton importable, any machine

The RL update is bound by host time (~6x its GPU time at one micro-batch, docs/performance.md),
and that host time is Python and dispatch that run the same on any machine. This runs one
packed micro-batch forward + backward (the update's call: `token_logprobs(..., with_grad=True)`,
a mean, `backward()`) of a small Qwen3-MoE model, each arm in a fresh process:

- `samebits`: the trainer as the on-policy arm runs it (samebits experts and attention,
  `trainer/forwards.py`, under `batch_invariant()`), every registry op taking its CUDA launcher,
  on CPU tensors posing as CUDA ones (`launcher_host.stub_launches`: each Triton launch a
  no-op, so outputs hold whatever memory they were given); shape-only stand-ins for what would
  be cuBLAS or flash on CUDA (the closed-form backwards' `torch.mm(..., out=)`, the experts'
  grouped GEMMs, flash attention's forward and backward);
- `stock`: transformers' `grouped_mm` experts and `sdpa` attention, no overrides registered
  (the stock arm's trainer), on stock CPU kernels that compute: its node count is what it asks
  of autograd, its ms are mostly bf16 CPU GEMMs and say nothing about CUDA.

Prints ms a micro-batch (median of `--reps`; forward and backward apart) and the autograd nodes a
layer. What the samebits arm leaves out: the C launcher and the driver (a few us a launch on
CUDA), the caching allocator, and `fast_launch`'s key (the launch is stubbed above it). So it
compares samebits' code before and after a change (run it on both checkouts); the H200 gives
the wall time (`benchmarks/rl_update_phases.py`). A probe: the samebits arm computes only the
small elementwise ops between its kernels.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import torch

# the kernel modules whose launches are stubbed (their launchers run, their kernels do not)
KERNEL_MODULES = (
    "matmul_triton",
    "norm_rope_triton",
    "norm_backward_triton",
    "norm_rope_backward_triton",
    "attention_launch",
    "experts_launch",
    "experts_backward_triton",
    "reduce_triton",
    "router_triton",
    "router_one_launch",
    "sample_launch",
)


def _config(layers: int):
    """The built-in tiny shape widened until every samebits launcher takes it (head_dim a power of
    two): 256 hidden, 4 + 2 heads of 64, 8 experts of 128, top-2, every layer sparse; its stock
    CPU compute stays small."""
    from transformers import Qwen3MoeConfig

    from samebits.model.qwen3_moe.tiny import TINY_SHAPE

    wider = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, head_dim=64)
    return Qwen3MoeConfig(
        **(TINY_SHAPE | wider | dict(num_hidden_layers=layers, num_experts=8, mlp_only_layers=[]))
    )


def _stub_samebits() -> None:
    """Every registry op on the CPU takes its CUDA entry; their Triton launches do nothing."""
    import launcher_host  # noqa: E402 - a sibling script (benchmarks/ is on the path when run)

    from samebits.kernels import attention as attention_kernels
    from samebits.model import attention
    from samebits.numerics import batch_invariant, registry

    # imported before the patch below: its overrides (installed on first entry) stay the CPU's
    assert batch_invariant.triton_available is registry.triton_available

    # the modules this checkout has (the script also times older checkouts, PYTHONPATH=old/src)
    launcher_host.MODULES = [m for m in KERNEL_MODULES if importlib.util.find_spec(f"samebits.kernels.{m}")]
    mods = launcher_host.stub_launches()
    experts = mods["experts_launch"]
    real_route, valid = experts.route_pairs, {}

    def route_pairs(top_k_index, num_experts):  # its launcher runs; the backward gathers by what
        real_route(top_k_index, num_experts)  # it returns, so it returns a valid route (cached)
        n = top_k_index.numel()
        if (n, num_experts) not in valid:
            ends = torch.linspace(0, n, num_experts + 1).round().to(torch.int32)
            valid[n, num_experts] = (torch.arange(n, dtype=torch.int32), ends)
        return valid[n, num_experts]

    experts.route_pairs = route_pairs
    # the router's one launch, as on the H200: its device test (logits on CUDA; this config's
    # 8 experts, top-2, contiguous rows pass the rest) and the torch its top-k order was checked on
    from samebits.kernels import router_one_launch, router_triton, topk_order

    router_triton.supported = router_one_launch.supported = lambda router_logits, top_k: True
    topk_order.order_checked = lambda k: True
    real_router, picks = router_one_launch.router, {}

    def router(router_logits, top_k, norm_topk_prob):  # its launcher runs; the indices it returns
        weights, _ = real_router(router_logits, top_k, norm_topk_prob)  # are gathered by: valid ones
        t, e = router_logits.shape
        if (t, e, top_k) not in picks:
            picks[t, e, top_k] = (torch.arange(t * top_k) % e).view(t, top_k)
        return weights, picks[t, e, top_k]

    router_one_launch.router = router
    registry.triton_available = lambda: True
    for row in registry.TABLE.values():
        if "cuda" in row:
            row["cpu"] = row["cuda"]
    attention._paged_attention.kernel = lambda device: attention._TRITON_ATTENTION
    attention._BACKWARD["cpu"] = attention_kernels.packed_attention_backward_flash

    def flash_forward(q, k, v, *args, **kwargs):  # -> out, lse, seed, offset, debug
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
        return q.new_empty(q.shape), lse, q.new_empty(2, dtype=torch.long), q.new_empty(()), None

    def flash_backward(grad, q, k, v, *args, **kwargs):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    torch.ops.aten._flash_attention_forward = flash_forward
    torch.ops.aten._flash_attention_backward = flash_backward

    def grouped_mm(a, b, offs=None):  # the output's shape (torch._grouped_mm's contract)
        if b.dim() == 3:
            return a.new_empty(a.shape[0], b.shape[2])
        return a.new_empty(len(offs), a.shape[0], b.shape[1])

    def experts_backward(*args, **kwargs):
        return experts_backward_cuda(*args, **kwargs, gmm=grouped_mm)

    experts_backward_cuda = registry.experts_backward  # the CUDA entry's function, its GEMMs stood in
    registry.experts_backward = experts_backward
    stock_mm = torch.mm

    def mm(a, b, *, out=None):  # the closed-form backwards' GEMMs (cuBLAS on CUDA): shapes only
        return out if out is not None else stock_mm(a, b)

    torch.mm = mm


def _nodes_per_layer(loss: torch.Tensor, layers: int) -> float:
    """Autograd nodes behind `loss` (the parameters' AccumulateGrad left out), a layer."""
    seen, stack = set(), [loss.grad_fn]
    kinds: collections.Counter = collections.Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kinds[type(node).__name__] += 1
        stack.extend(n for n, _ in node.next_functions)
    return (sum(kinds.values()) - kinds["AccumulateGrad"]) / layers


def run_arm(arm: str, layers: int, seqs: int, tokens: int, reps: int) -> dict:
    """-> {'forward_ms', 'backward_ms', 'nodes_per_layer'} of one arm, in this process."""
    from transformers import AutoModelForCausalLM

    from samebits import trainer
    from samebits.numerics.batch_invariant import batch_invariant

    torch.manual_seed(0)
    samebits = arm == "samebits"
    if samebits:
        _stub_samebits()
        impl = dict(experts_implementation="samebits", attn_implementation="samebits")
    else:
        impl = dict(experts_implementation="grouped_mm", attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(_config(layers), dtype=torch.bfloat16, **impl)
    trainer.reset_rotary_inv_freq(model)
    if samebits:
        trainer.use_samebits_forwards(model)
    for name, p in model.named_parameters():  # the RL runs' frozen experts
        p.requires_grad_("experts" not in name)
    data = [[(7 * i + j) % 500 + 1 for j in range(tokens)] for i in range(seqs)]

    def forward():
        with batch_invariant() if samebits else torch.no_grad(), torch.enable_grad():
            lps = trainer.token_logprobs(model, data, [1] * seqs, packed=True, with_grad=True)
        return -torch.cat(lps).mean()

    nodes = _nodes_per_layer(forward(), layers)
    times = []
    for i in range(reps + 2):  # two warm-up runs
        t0 = time.perf_counter()
        loss = forward()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if i >= 2:
            times.append((t1 - t0, t2 - t1))
    fwd = statistics.median(t[0] for t in times) * 1e3
    bwd = statistics.median(t[1] for t in times) * 1e3
    return {"forward_ms": fwd, "backward_ms": bwd, "nodes_per_layer": nodes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="samebits", help="samebits, stock (comma-separated)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seqs", type=int, default=3, help="sequences packed in the micro-batch")
    p.add_argument("--tokens", type=int, default=32, help="tokens a sequence")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    from rich.console import Console
    from rich.table import Table

    results = {}
    for arm in args.arms.split(","):  # each arm in a fresh process: the stubs and overrides stay
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results[arm] = pool.submit(run_arm, arm, args.layers, args.seqs, args.tokens, args.reps).result()
    title = (
        f"trainer host ms, one micro-batch of {args.seqs} x {args.tokens} tokens, {args.layers} layers "
        "(median; samebits' kernels stubbed)"
    )
    table = Table(title=title)
    for col in ("arm", "forward ms", "backward ms", "per layer ms", "nodes a layer"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for arm, r in results.items():
        per_layer = (r["forward_ms"] + r["backward_ms"]) / args.layers
        table.add_row(
            arm,
            f"{r['forward_ms']:.2f}",
            f"{r['backward_ms']:.2f}",
            f"{per_layer:.3f}",
            f"{r['nodes_per_layer']:.1f}",
        )
    Console(width=110).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
