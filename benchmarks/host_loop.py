"""The engine's host loop per decode step, without the device: what `LLM.generate` spends in
Python around the model (scheduler, block manager, core, outputs, and the CUDA graphs' input
fill) at a given batch.

    python benchmarks/host_loop.py                    # batches 1, 64, 256 on the tiny model
    python benchmarks/host_loop.py --batches 256 --context 1024
    python benchmarks/host_loop.py --batches 64 --context 1024 --steps 1 --async-scheduling on \
        --prefix-caching off --max-num-batched-tokens 8192   # a prefill's steps: how many run ahead

The model step is replaced by a stub that returns one fixed (token, log-prob) per sampling
row, after filling the decode graphs' static inputs from the batch as the CUDA runner does
(`DecodeGraphs._fill`, on host tensors; no graph is captured). So the time per step is the
host work a GPU step would wait on or overlap with, and nothing else. Prompts of `--context`
tokens, `--steps` new tokens each; the first call warms up; ms per step is the mean of the
second call's engine steps in which all `batch` rows decoded (`EngineCore.step`: schedule,
the stub runner, postprocess, outputs), and the fill's share is printed beside it, with the
share spent in Python's garbage collector during those steps (`gc.callbacks`). The mean
includes every collection that lands in a measured step: a full (generation 2) collection
scans the whole heap and takes tens of ms here, so a run where one lands shows it.
`--async-scheduling on` plans each step while the one before is (on a GPU) still running
(`EngineCore._launch_ahead`); the `ahead` column counts the steps of the measured call
launched that way, of all its steps (prefill steps included).
"""

from __future__ import annotations

import argparse
import gc
import time

from samebits import LLM, SamplingParams
from samebits.engine.cuda_graphs import DecodeGraphs, graph_sizes
from samebits.engine.sampler import Pending
from samebits.model.qwen3_moe.tiny import tiny_checkpoint_cache


def measure(batch: int, context: int, steps: int, ahead: bool = False, **limits) -> tuple:
    """-> (ms per full-batch decode step, ms of it in the graph input fill, ms of it in the
    garbage collector, such steps, "launched ahead / all steps"); `limits`: more `LLM` options."""
    length = context + steps + 16
    llm = LLM(
        tiny_checkpoint_cache(), max_num_seqs=batch, max_model_len=length, async_scheduling=ahead, **limits
    )
    pages = -(-(context + steps + 16) // llm.engine.block_size)
    graphs = DecodeGraphs(llm.runner, graph_sizes(batch), pages, dummy_block=llm.block_manager.num_blocks)
    acc = {"full": False, "fill": 0.0, "step": 0.0, "n": 0, "in_step": False, "gc": 0.0, "gc_t0": 0.0}
    acc.update(launches=0, ahead=0)

    def collected(phase, info):  # gc.callbacks: time in collections inside the counted steps
        if phase == "start":
            acc["gc_t0"] = time.perf_counter()
        elif acc["in_step"]:
            acc["gc"] += time.perf_counter() - acc["gc_t0"]

    def stub(b, reqs, ahead=None):  # the runner: the graphs' input fill, then one fixed sample per row
        acc["launches"] += 1
        acc["ahead"] += ahead is not None
        size = graphs.size_for(b) if ahead is None or -1 not in ahead[0] else None
        acc["full"] = size is not None and len(b.chunks) == batch
        if size is not None:
            t0 = time.perf_counter()
            graphs._fill(b, size, reqs, ahead)
            acc["fill"] += time.perf_counter() - t0 if acc["full"] else 0.0
        return Pending.done([(5, -1.0)] * len(reqs), "cpu")

    core_step = llm.core.step

    def step():  # one engine step, counted when all `batch` rows decoded in it
        t0, gc0 = time.perf_counter(), acc["gc"]
        acc["in_step"] = True
        out = core_step()
        acc["in_step"] = False
        if acc["full"]:
            acc["step"] += time.perf_counter() - t0
            acc["n"] += 1
        else:
            acc["gc"] = gc0  # a collection in an uncounted step
        return out

    llm.runner.launch, llm.core.step = stub, step
    prompts = [[(i * 31 + j) % 250 + 1 for j in range(context)] for i in range(batch)]
    params = SamplingParams(max_tokens=steps, ignore_eos=True, seed=1, detokenize=False)
    llm.generate(prompts, params, progress=False)  # warm-up
    acc.update(fill=0.0, step=0.0, n=0, gc=0.0, launches=0, ahead=0)
    gc.callbacks.append(collected)
    try:
        llm.generate(prompts, params, progress=False)
    finally:
        gc.callbacks.remove(collected)
    n = max(acc["n"], 1)
    ran = f"{acc['ahead']}/{acc['launches']}"
    return 1000 * acc["step"] / n, 1000 * acc["fill"] / n, 1000 * acc["gc"] / n, acc["n"], ran


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--context", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--steps", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument(
        "--async-scheduling", choices=("on", "off"), default="off", help="plan steps ahead (default off)"
    )
    p.add_argument(
        "--prefix-caching",
        choices=("on", "off"),
        default="on",
        help="prefix sharing (default on; off: the measured call computes every prompt the warm-up did)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the step budget (the engine's)")
    args = p.parse_args()
    limits = {"enable_prefix_caching": args.prefix_caching == "on"}
    if args.max_num_batched_tokens:
        limits["max_num_batched_tokens"] = args.max_num_batched_tokens
    print(f"{'batch':>6} {'full steps':>10} {'ms/step':>8} {'fill ms':>8} {'gc ms':>8} {'ahead':>9}")
    for b in (int(x) for x in args.batches.split(",")):
        ahead = args.async_scheduling == "on"
        ms, fill_ms, gc_ms, n, ran = measure(b, args.context, args.steps, ahead, **limits)
        print(f"{b:>6} {n:>10} {ms:>8.3f} {fill_ms:>8.3f} {gc_ms:>8.3f} {ran:>9}")


if __name__ == "__main__":
    main()
