"""The whole model from a trainer process into `samebits serve` on the same GPU (CUDA IPC),
against the in-process `LLM.update_weights`.

    python benchmarks/weight_sync.py --layers 48 --dir /dev/shm/q48 --out sync.json

1. `samebits serve` on the checkpoint (a small KV cache: two copies of the model share the GPU).
2. This process is the trainer: it reads the checkpoint's tensors onto the GPU (bf16), changes
   two of them, and pushes all of them with `samebits.client.Client.update_weights_from_tensor`
   (CUDA IPC handles; the server opens them, checks every value is finite, copies, syncs).
   Timed `--repeats` times, wall clock around the HTTP call. The server's digests (kind "fast",
   on the GPU) must equal the trainer's afterwards, and a request must still complete.
3. The server stops; one process holds an `LLM` and the same tensors and times
   `llm.update_weights(pairs)` (same checks, same copies, no process boundary).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _trainer_tensors(path: Path, device: str) -> list[tuple[str, torch.Tensor]]:
    from samebits.model.qwen3_moe.loader import load_state_dict

    _, state = load_state_dict(path, dtype=torch.bfloat16, device=device)
    with torch.no_grad():  # an "optimizer step" the server must pick up
        state["model.layers.0.self_attn.q_proj.weight"].mul_(0.5)
        state["lm_head.weight"].neg_()
    return list(state.items())


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--dir", default="/dev/shm/q48")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run)")
    args = p.parse_args()
    from samebits.bench import write_random_checkpoint
    from samebits.client import Client, spawn_server, stop_server

    path = Path(args.dir)
    if not (path / "config.json").is_file():
        write_random_checkpoint(path, args.layers, 0)
    result: dict = {"layers": args.layers}
    args_ = ["--device", args.device, "--max-num-seqs", "4", "--max-model-len", "256", "--num-blocks", "64"]
    proc, url = spawn_server(path, *args_)  # a small KV cache: two copies of the model share the GPU
    try:
        client = Client(url, timeout=600)
        pairs = _trainer_tensors(path, args.device)
        nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
        result["bytes"] = nbytes
        before = client.weight_digests(kind="fast")
        messages: list[str] = []
        ipc = _timed(lambda: messages.append(client.update_weights_from_tensor(pairs)), args.repeats)
        after = client.weight_digests(kind="fast")
        local = client.local_digests(pairs, kind="fast")
        changed = sorted(n for n in after if after[n] != before[n])
        result |= {
            "ipc_s": ipc,
            "server_messages": messages,
            "digests_equal": after == local,
            "changed": changed,
        }
        gen = client.generate(list(range(2, 34)), {"max_new_tokens": 8, "temperature": 0})
        result["generate_after"] = gen["output_ids"]
        print(f"IPC sync of {nbytes / 1e9:.1f} GB: {[f'{t:.3f}' for t in ipc]} s; server: {messages[-1]}")
        print(f"digests equal: {after == local}; tensors changed: {changed}")
        del pairs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    finally:
        stop_server(proc)
    from samebits import LLM

    llm = LLM(path, device=args.device, max_num_seqs=4, max_model_len=256, num_blocks=64)
    pairs = _trainer_tensors(path, args.device)
    inproc = _timed(lambda: llm.update_weights(pairs), args.repeats)
    result["in_process_s"] = inproc
    print(f"in-process update_weights: {[f'{t:.3f}' for t in inproc]} s")
    ratio = statistics.median(ipc) / statistics.median(inproc)
    print(f"IPC / in-process (medians): {ratio:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
