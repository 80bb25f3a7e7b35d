"""`samebits serve` against `LLM.generate` on the same work, and the trainer's bits (CUDA).

    python benchmarks/serve_http.py --layers 48 --requests 64 --tokens 256

Writes a random Qwen3-30B-A3B-shaped checkpoint, loads the trainer's model once and runs
the engine on its tensors (`LLM(weights=...)`, one copy on the device), then:
  offline: `LLM.generate` of N requests (prompt 32 tokens, `--tokens` new, seeds 0..N-1);
  http:    the same N requests as concurrent streaming /v1/completions over 127.0.0.1
           (uvicorn in this process, the AsyncEngine's thread behind it);
and prints output tokens/s of both arms, whether every HTTP request equals its offline
twin (tokens and float32 log-probs, bitwise), and mismatches against the trainer's packed
recompute under `batch_invariant()`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import torch


def _serve(llm):
    import uvicorn

    from samebits.engine.async_engine import AsyncEngine
    from samebits.serve.app import build_app

    engine = AsyncEngine(llm)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "bench"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return engine, server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def _stream_one(client, url: str, prompt: list[int], tokens: int, seed: int):
    body = {"prompt": prompt, "max_tokens": tokens, "seed": seed, "logprobs": 0, "stream": True}
    body |= {"ignore_eos": True, "return_token_ids": True, "model": "bench"}
    ids, lps = [], []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                ids += choice["token_ids"]
                lps += choice["logprobs"]["token_logprobs"]
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
    model = trainer.load_hf_model(path, device=args.device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else lambda: None
    llm = LLM(
        path,
        device=args.device,
        weights=model.named_parameters(remove_duplicate=False),
        max_num_seqs=args.requests,
        max_model_len=32 + args.tokens + 16,
    )
    prompts = make_prompts([32] * args.requests, llm.config.vocab_size, seed=1)
    params = [SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=i) for i in range(args.requests)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm up kernels and graphs
    sync()
    t0 = time.perf_counter()
    offline = llm.generate(prompts, params)
    sync()
    t_offline = time.perf_counter() - t0

    engine, server, thread, url = _serve(llm)
    asyncio.run(_http(url, prompts, 4))  # warm up the HTTP path
    t0 = time.perf_counter()
    http = asyncio.run(_http(url, prompts, args.tokens))
    t_http = time.perf_counter() - t0
    server.should_exit = True
    thread.join(timeout=60)
    engine.close()

    same = sum(
        ids == o.token_ids and torch.equal(torch.tensor(lps, dtype=torch.float32), o.logprobs)
        for (ids, lps), o in zip(http, offline, strict=True)
    )
    seqs = [pr + o.token_ids for pr, o in zip(prompts, offline, strict=True)]
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
    print(f"{args.layers} layers, {args.requests} requests x {args.tokens} tokens")
    print(f"offline LLM.generate : {n_tok / t_offline:10.1f} output tok/s ({t_offline:.2f} s)")
    print(
        f"HTTP (streaming)     : {n_tok / t_http:10.1f} output tok/s ({t_http:.2f} s), "
        f"{t_http / t_offline:.3f}x the offline time"
    )
    print(f"HTTP == offline      : {same}/{args.requests} requests bitwise")
    print(f"trainer mismatches   : {bad}/{total} tokens")


if __name__ == "__main__":
    main()
