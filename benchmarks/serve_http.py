"""`samebits serve` against `LLM.generate` on the same work, and the trainer's bits (CUDA).

    python benchmarks/serve_http.py --layers 48 --requests 64 --tokens 256

Writes a random Qwen3-30B-A3B-shaped checkpoint (or takes --model), then, with one copy of
the model on the device at a time:
  offline: `LLM.generate` of N requests (prompt 32 tokens, `--tokens` new, seeds 0..N-1);
  http:    `samebits serve` started as a user starts it (its engine in a process of its
           own), the same N requests as concurrent streaming /v1/completions over
           127.0.0.1 from this process, timed from the first request to the last byte;
and prints output tokens/s of both arms, whether every HTTP request equals its offline
twin (tokens and float32 log-probs, bitwise), and mismatches against the trainer's packed
recompute under `batch_invariant()`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from pathlib import Path

import torch


def _serve(path: Path, args):
    """`samebits serve` on 127.0.0.1 as a user starts it; -> (process, url)."""
    from samebits.client import spawn_server

    flags = ["--device", args.device, "--max-num-seqs", str(args.requests)]
    return spawn_server(path, *flags, "--max-model-len", str(32 + args.tokens + 16))


async def _stream_one(client, url: str, prompt: list[int], tokens: int, seed: int):
    body = {"prompt": prompt, "max_tokens": tokens, "seed": seed, "logprobs": 0, "stream": True}
    body |= {"ignore_eos": True, "return_token_ids": True}
    ids, lps = [], []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                ids += choice["token_ids"]
                lps += choice["logprobs"]["token_logprobs"]
    if len(ids) != tokens:
        raise RuntimeError(f"request {seed}: {len(ids)} of {tokens} tokens came back")
    return ids, lps


async def _http(url: str, prompts, tokens: int):
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        return await asyncio.gather(*[_stream_one(client, url, p, tokens, i) for i, p in enumerate(prompts)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--dir", default="/dev/shm/samebits-serve-bench")
    p.add_argument("--reuse", action="store_true", help="use the checkpoint already in --dir")
    p.add_argument("--model", default=None, help="an existing checkpoint instead (e.g. a tiny one)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    from samebits import LLM, SamplingParams, batch_invariant, trainer
    from samebits.bench import write_random_checkpoint
    from samebits.verify import make_prompts

    path = Path(args.model or args.dir)
    if not args.model and not (args.reuse and (path / "config.json").is_file()):
        write_random_checkpoint(path, args.layers, 0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else lambda: None
    llm = LLM(path, device=args.device, max_num_seqs=args.requests, max_model_len=32 + args.tokens + 16)
    prompts = make_prompts([32] * args.requests, llm.config.vocab_size, seed=1)
    params = [SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=i) for i in range(args.requests)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm up kernels and graphs
    sync()
    t0 = time.perf_counter()
    offline = llm.generate(prompts, params)
    sync()
    t_offline = time.perf_counter() - t0
    del llm  # one copy of the model on the device at a time
    gc.collect()
    torch.cuda.empty_cache() if args.device.startswith("cuda") else None

    proc, url = _serve(path, args)
    try:
        asyncio.run(_http(url, prompts, 4))  # warm up the HTTP path
        t0 = time.perf_counter()
        http = asyncio.run(_http(url, prompts, args.tokens))
        t_http = time.perf_counter() - t0
        steps = _metric(url, "samebits_engine_steps_total")
        step_s = _metric(url, "samebits_engine_step_seconds_total")
    finally:
        from samebits.client import stop_server

        stop_server(proc)

    same = sum(
        ids == o.token_ids and torch.equal(torch.tensor(lps, dtype=torch.float32), o.logprobs)
        for (ids, lps), o in zip(http, offline, strict=True)
    )
    seqs = [pr + o.token_ids for pr, o in zip(prompts, offline, strict=True)]
    model = trainer.load_hf_model(path, device=args.device, dtype=torch.bfloat16)
    bad = total = 0
    for start in range(0, len(seqs), 8):  # packed recompute, 8 sequences at a time
        with batch_invariant():
            lps = trainer.token_logprobs(
                model, seqs[start : start + 8], [32] * len(seqs[start : start + 8]), packed=True
            )
        for o, lp in zip(offline[start : start + 8], lps, strict=True):
            bad += int((o.logprobs != lp.cpu()).sum())
            total += lp.numel()
    n_tok = args.requests * args.tokens
    print(f"{path}: {args.requests} requests x {args.tokens} tokens")
    print(f"offline LLM.generate : {n_tok / t_offline:10.1f} output tok/s ({t_offline:.2f} s)")
    print(
        f"HTTP (streaming)     : {n_tok / t_http:10.1f} output tok/s ({t_http:.2f} s), "
        f"{t_http / t_offline:.3f}x the offline time"
    )
    per_step = 1000 * step_s / max(steps, 1)
    print(f"server engine        : {steps:.0f} steps, {per_step:.2f} ms each (warm-up included)")
    print(f"HTTP == offline      : {same}/{args.requests} requests bitwise")
    print(f"trainer mismatches   : {bad}/{total} tokens")


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError(f"/metrics has no {name}")


if __name__ == "__main__":
    main()
