"""The parity probe at the Qwen3-30B-A3B shape with random bf16 weights (CUDA).

    python benchmarks/probe_real_shape.py --layers 4 --tokens 1000 --out probe.json

Writes a random checkpoint (fused experts layout) through samebits' own saver,
then runs `samebits.verify.run` on it: rollout seq0 alone and 4 concurrent
requests (prompts 10/16/16/24), trainer one at a time and packed-4, and the
grouped_mm / sdpa negative controls.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    eos_token_id=151645,
)


def write_random_checkpoint(path: Path, layers: int, seed: int) -> Path:
    from transformers import Qwen3MoeConfig

    from samebits.model.config import ModelConfig
    from samebits.model.loader import expected_shapes, save_state_dict

    cfg_dict = Qwen3MoeConfig(num_hidden_layers=layers, **QWEN3_30B_A3B).to_dict()
    cfg_dict["architectures"] = ["Qwen3MoeForCausalLM"]
    cfg_dict["dtype"] = "bfloat16"
    shapes = expected_shapes(ModelConfig.from_dict(cfg_dict))
    g = torch.Generator(device="cuda").manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            t = 1 + 0.1 * torch.randn(shape, device="cuda", generator=g)
        else:
            t = torch.randn(shape, device="cuda", generator=g) * shape[-1] ** -0.5
        state[name] = t.bfloat16().cpu()
    return save_state_dict(cfg_dict, state, path, max_shard_bytes=4 << 30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default="/tmp/samebits-probe")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from samebits import verify

    t0 = time.time()
    path = write_random_checkpoint(Path(args.dir), args.layers, args.seed)
    print(f"checkpoint: {args.layers} layers at {path} in {time.time() - t0:.0f} s", flush=True)
    t0 = time.time()
    results = verify.run(model=path, device="cuda", tokens=args.tokens, seed=args.seed)
    print(f"probe: {time.time() - t0:.0f} s", flush=True)
    verify.print_table(results)
    print("PASS" if verify.passed(results) else "FAIL")
    if args.out:
        verify.write_json(results, args.out)


if __name__ == "__main__":
    main()
