"""`samebits bench`: decode speed of the exact and fast profiles and of transformers
`generate`, and the trainer's packed forward+backward, on one model, in one run.

Decode arms time real engine steps (`ModelRunner.run`: batch assembly, the
forward, CUDA-graph replay where it applies, sampling, the host sync) of B
sequences that each hold `context` tokens of KV. transformers `generate` is
timed as (t(1 + n new tokens) - t(1 new token)) / n, which removes its prefill.
Each arm gets the fraction of the memory floor: the bytes a step must read
(weights it touches + KV) over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from samebits.engine.sampler import SampleRequest
from samebits.engine.scheduler import ScheduledBatch, ScheduledChunk
from samebits.engine.sequence import Sequence
from samebits.model.config import ModelConfig
from samebits.numerics.profile import PROFILES
from samebits.plotting import pyplot
from samebits.requests import SamplingParams

ARMS = ("exact", "fast", "hf", "trainer")
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


@dataclass
class Row:
    arm: str
    batch: int
    context: int
    step_ms: float
    tokens_per_s: float
    floor_ms: float

    @property
    def floor_fraction(self) -> float:
        return self.floor_ms / self.step_ms


def write_random_checkpoint(path: Path, layers: int, seed: int, shard_bytes: int = 4 << 30) -> Path:
    """A Qwen3-30B-A3B-shaped checkpoint (fused experts) with random bf16 weights, written
    shard by shard (never the whole model in host memory). Needs CUDA for the generator."""
    from transformers import Qwen3MoeConfig

    from samebits.model.loader import expected_shapes, save_tensor_stream

    cfg = Qwen3MoeConfig(num_hidden_layers=layers, **QWEN3_30B_A3B).to_dict()
    cfg["architectures"], cfg["dtype"] = ["Qwen3MoeForCausalLM"], "bfloat16"
    g = torch.Generator(device="cuda").manual_seed(seed)

    def tensors():
        for name, shape in expected_shapes(ModelConfig.from_dict(cfg)).items():
            if len(shape) == 1:
                yield name, (1 + 0.1 * torch.randn(shape, device="cuda", generator=g)).bfloat16()
            else:
                yield name, (torch.randn(shape, device="cuda", generator=g) * shape[-1] ** -0.5).bfloat16()

    return save_tensor_stream(cfg, tensors(), path, shard_bytes)


def copy_bandwidth(device, nbytes: int = 4 << 30) -> float:
    """Device memory bandwidth in bytes/s, from a timed copy (read + write counted)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize(device)
    return 2 * nbytes * 10 / (time.perf_counter() - t0)


def step_bytes(cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 2) -> int:
    """Bytes one decode step must read: dense weights, the experts the batch touches
    (expected distinct experts under uniform routing), lm_head, and the KV of every row."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    expert = 3 * h * cfg.moe_intermediate_size
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    per_layer = attn + touched * expert + e * h
    kv = batch * context * 2 * cfg.num_key_value_heads * d
    return dtype_bytes * (cfg.num_hidden_layers * (per_layer + kv) + cfg.vocab_size * h + batch * h)


replay_ms: dict[tuple[str, int], float] = {}  # (profile, batch) -> CUDA-graph replay alone


def engine_step_ms(llm, batch: int, context: int, steps: int = 20) -> float:
    """Mean time of `steps` decode steps (after 3 warm-up steps) of `batch` sequences that
    each hold `context` tokens of KV; also records the graph replay alone in `replay_ms`."""
    g = torch.Generator().manual_seed(batch)
    seqs = []
    for i in range(batch):
        ids = torch.randint(0, llm.config.vocab_size, (context,), generator=g).tolist()
        seq = Sequence(seq_id=-1 - i, index=i, prompt_token_ids=ids, params=SamplingParams(max_tokens=1))
        llm.block_manager.allocate(seq, context)
        seq.num_computed_tokens = context - 1
        seqs.append(seq)
    batch_ = ScheduledBatch([ScheduledChunk(s, context - 1, 1) for s in seqs])
    reqs = [SampleRequest(s.params, i, 0) for i, s in enumerate(seqs)]
    try:
        with llm.runner.profile.context():  # as LLM.generate: installed once, not per step
            for _ in range(3):
                llm.runner.run(batch_, reqs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                llm.runner.run(batch_, reqs)
            torch.cuda.synchronize()
            step = 1000 * (time.perf_counter() - t0) / steps
            graphs = llm.runner.graphs
            size = graphs.size_for(batch_) if graphs is not None else None
            if size is not None and size in graphs.graphs:  # the replay alone: the GPU's share
                t0 = time.perf_counter()
                for _ in range(steps):
                    graphs.graphs[size][0].replay()
                torch.cuda.synchronize()
                replay_ms[(llm.runner.profile.name, batch)] = 1000 * (time.perf_counter() - t0) / steps
        return step
    finally:
        for s in seqs:
            llm.block_manager.free(s)


def hf_generate_step_ms(model, batch: int, context: int, new: int = 16) -> float:
    """transformers `generate` decode step time, its prefill removed."""
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=model.device)

    def timed(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(2)
    return 1000 * (timed(1 + new) - timed(1)) / new


def trainer_step_ms(model, tokens_per_seq: int = 1024, seqs: int = 4, exact: bool = True) -> float:
    """Packed forward+backward of `seqs` x `tokens_per_seq` tokens (mean log-prob loss)."""
    from samebits import trainer
    from samebits.numerics.batch_invariant import batch_invariant

    g = torch.Generator().manual_seed(0)
    data = [
        torch.randint(0, model.config.vocab_size, (tokens_per_seq,), generator=g).tolist() for _ in range(seqs)
    ]

    def once():
        with batch_invariant() if exact else contextlib.nullcontext():
            lps = trainer.token_logprobs(model, data, [1] * seqs, packed=True, with_grad=True)
            loss = -torch.cat(lps).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        once()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / 3


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def print_table(rows: list[Row], trainer_rows: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="samebits bench: decode step")
    for c in ("arm", "batch", "context", "ms/step", "tok/s", "floor ms", "of floor"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(
            r.arm,
            str(r.batch),
            str(r.context),
            f"{r.step_ms:.2f}",
            f"{r.tokens_per_s:,.0f}",
            f"{r.floor_ms:.2f}",
            f"{r.floor_fraction:.0%}",
        )
    console = Console()
    console.print(t)
    if trainer_rows:
        tt = Table(title="trainer: packed forward+backward")
        tt.add_column("arm")
        tt.add_column("ms", justify="right")
        for k, v in trainer_rows.items():
            tt.add_row(k, f"{v:.1f}")
        console.print(tt)


def write_outputs(rows: list[Row], trainer_rows: dict[str, float], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "meta": meta,
        "decode": [asdict(r) | {"floor_fraction": r.floor_fraction} for r in rows],
        "trainer_ms": trainer_rows,
    }
    (out / "bench.json").write_text(json.dumps(data, indent=2))
    plt = pyplot(str(out / "bench.png"))
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in dict.fromkeys(r.arm for r in rows):
        pts = [r for r in rows if r.arm == arm]
        ax.plot([r.batch for r in pts], [r.tokens_per_s for r in pts], marker="o", label=arm)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"decode at {rows[0].context if rows else 0} tokens of context")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=120)


def run(
    model: str | Path,
    batches=(1, 8, 32, 64, 256),
    context: int = 1024,
    arms=ARMS,
    hf_batches=None,
    steps: int = 20,
    log=print,
) -> tuple[list[Row], dict[str, float], dict]:
    """Run the chosen arms on CUDA; returns (decode rows, trainer ms by arm, run facts)."""
    from samebits.engine.llm import LLM

    if not torch.cuda.is_available():
        raise RuntimeError("samebits bench measures CUDA decode steps; no CUDA device is visible")
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    meta = {"device": torch.cuda.get_device_name(dev), "copy_GBps": bw / 1e9, "model": str(model)}
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s on {meta['device']}")
    rows: list[Row] = []
    cfg = None
    engine_arms = [a for a in arms if a in PROFILES]
    if engine_arms:
        t0 = time.perf_counter()
        llm = LLM(model, device="cuda", max_num_seqs=max(batches), max_model_len=context + 16)
        cfg = llm.config
        log(f"engine built in {time.perf_counter() - t0:.0f} s")
        for arm in engine_arms:
            llm.set_numerics(arm)
            for b in batches:
                ms = engine_step_ms(llm, b, context, steps)
                rows.append(Row(arm, b, context, ms, 1000 * b / ms, 1000 * step_bytes(cfg, b, context) / bw))
                log(
                    f"{arm:>6} batch {b:>4}: {ms:.2f} ms/step "
                    f"(graph replay {replay_ms.get((arm, b), 0):.2f} ms)"
                )
        meta["graph_replay_ms"] = {f"{a}/batch {b}": ms for (a, b), ms in replay_ms.items()}
        del llm
        free_memory()
    trainer_rows: dict[str, float] = {}
    if "hf" in arms or "trainer" in arms:
        from transformers import AutoModelForCausalLM

        from samebits import trainer

        if "hf" in arms:
            hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, device_map="cuda").eval()
            cfg = cfg or ModelConfig.from_pretrained(model)
            for b in hf_batches or batches:
                with torch.inference_mode():
                    ms = hf_generate_step_ms(hf, b, context)
                rows.append(
                    Row("transformers", b, context, ms, 1000 * b / ms, 1000 * step_bytes(cfg, b, context) / bw)
                )
                log(f"transformers batch {b:>4}: {ms:.2f} ms/step")
            del hf
            free_memory()
        if "trainer" in arms:
            for name, impl, exact in (
                ("samebits kernels (exact)", {}, True),
                (
                    "stock transformers (grouped_mm + sdpa)",
                    {"experts_implementation": "grouped_mm", "attn_implementation": "sdpa"},
                    False,
                ),
            ):
                m = trainer.load_hf_model(model, device="cuda", **impl)
                for n, p in m.named_parameters():  # experts frozen: their grads alone would not fit beside them
                    p.requires_grad_("mlp.experts" not in n)
                m.train()
                trainer_rows[name] = trainer_step_ms(m, exact=exact)
                log(f"trainer {name}: {trainer_rows[name]:.1f} ms")
                del m
                free_memory()
    return rows, trainer_rows, meta
