"""`samebits bench`: what users see of the exact and fast profiles, beside what the GPU
does, and the stock baselines (transformers `generate`, the trainer, the RL step), on one
model, in one run.

Per engine arm and batch B (each of B sequences at `context` tokens):
- through `LLM.generate` (`bench.generate`): decode ms per output token (the median
  step in which all B rows decode) and
  prefill tok/s, everything the user waits for (scheduler, host loop, sampling);
- the engine step (`ModelRunner.run`: batch assembly, the forward, CUDA-graph replay,
  sampling, the host sync) and the graph replay alone, the GPU's share;
- the memory floor: the bytes a step must read (weights it touches + KV) over the copy
  bandwidth measured in the same run.
Per engine arm, a rollout of R prompts x (P -> G tokens) through `generate`, as output tok/s.
transformers `generate` is timed as (t(1 + n new tokens) - t(1 new token)) / n, which
removes its prefill. The RL step ratio (`samebits.rl.arms`) is measured by the CLI and
joins the result there. Results: `bench.report`.
"""

from __future__ import annotations

import contextlib
import gc
import time
from pathlib import Path

import torch

from samebits.bench.generate import generate_max_len, measure_generate, measure_rollout, random_ids, sync
from samebits.bench.report import EXACT_TRAINER, STOCK_TRAINER, BenchResult, Row
from samebits.engine.sampler import SampleRequest
from samebits.engine.scheduler import ScheduledBatch, ScheduledChunk
from samebits.engine.sequence import Sequence
from samebits.model.qwen3_moe.config import ModelConfig
from samebits.numerics.profile import PROFILES
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


def write_random_checkpoint(path: Path, layers: int, seed: int, shard_bytes: int = 4 << 30) -> Path:
    """A Qwen3-30B-A3B-shaped checkpoint (fused experts) with random bf16 weights, written
    shard by shard (never the whole model in host memory). Needs CUDA for the generator."""
    from transformers import Qwen3MoeConfig

    from samebits.model.qwen3_moe.loader import expected_shapes, save_tensor_stream

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


# the floors `samebits bench` states per row (docs/speed-measurements.md has the arithmetic):
# the card's nominal HBM bandwidth, bytes/s, by a substring of torch's device name (H100 SXM:
# "NVIDIA H100 80GB HBM3"), and the bf16 dense rate issue 45 takes for the prefill floor
NOMINAL_BANDWIDTH = (("H200", 4.8e12), ("H100 80GB HBM3", 3.35e12), ("H100 SXM", 3.35e12))
PREFILL_FLOPS = 790e12


def nominal_bandwidth(device_name: str) -> float | None:
    """The card's nominal memory bandwidth in bytes/s, or None for a card not listed."""
    return next((bw for key, bw in NOMINAL_BANDWIDTH if key in device_name), None)


def prefill_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """FLOPs of one prompt token in a prefill of `context`-token prompts: 2 per active
    weight (attention projections, the router, top-k experts; no lm_head, which a prefill
    with max_tokens=1 applies to the last token only) plus causal attention's QK^T and PV at
    the mean causal length (context + 1) / 2."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    experts = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    router = cfg.num_experts * h
    scores = 2 * 2 * cfg.num_attention_heads * d * (context + 1) / 2
    return cfg.num_hidden_layers * (2 * (attn + experts + router) + scores)


def floors(cfg: ModelConfig, batch: int, context: int, device_name: str) -> tuple[float | None, float]:
    """(decode floor ms at the card's nominal bandwidth, or None for an unlisted card;
    prefill floor tok/s at PREFILL_FLOPS)."""
    bw = nominal_bandwidth(device_name)
    decode = None if bw is None else 1000 * step_bytes(cfg, batch, context) / bw
    return decode, PREFILL_FLOPS / prefill_flops_per_token(cfg, context)


replay_ms: dict[tuple[str, int], float] = {}  # (profile, batch) -> CUDA-graph replay alone


@contextlib.contextmanager
def decode_batch(llm, batch: int, context: int):
    """A decode step of `batch` sequences that each hold `context` tokens of KV, as the
    runner takes it: yields (ScheduledBatch, sample requests); frees the blocks after."""
    g = torch.Generator().manual_seed(batch)
    seqs = []
    try:
        for i in range(batch):
            ids = random_ids(llm.config.vocab_size, (context,), g, llm.family.never_sample).tolist()
            seq = Sequence(seq_id=-1 - i, index=i, prompt_token_ids=ids, params=SamplingParams(max_tokens=1))
            llm.block_manager.allocate(seq, context)
            seq.num_computed_tokens = context - 1
            seqs.append(seq)
        yield (
            ScheduledBatch([ScheduledChunk(s, context - 1, 1) for s in seqs]),
            [SampleRequest(s.params, i, 0) for i, s in enumerate(seqs)],
        )
    finally:
        for s in seqs:
            llm.block_manager.free(s)


def engine_step_ms(llm, batch: int, context: int, steps: int = 20) -> float:
    """Mean time of `steps` decode steps (after 3 warm-up steps) of `batch` sequences that
    each hold `context` tokens of KV; also records the graph replay alone in `replay_ms`."""
    with decode_batch(llm, batch, context) as (batch_, reqs), llm.runner.profile.context():
        # the profile as LLM.generate installs it: once, not per step
        for _ in range(3):
            llm.runner.run(batch_, reqs)
        sync(llm)
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.runner.run(batch_, reqs)
        sync(llm)
        step = 1000 * (time.perf_counter() - t0) / steps
        graphs = llm.runner.graphs
        size = graphs.size_for(batch_) if graphs is not None else None
        if size is not None and (size, True) in graphs.graphs:  # the replay alone: the GPU's share
            t0 = time.perf_counter()
            for _ in range(steps):
                graphs.graphs[size, True][0].replay()
            sync(llm)
            replay_ms[(llm.runner.profile.name, batch)] = 1000 * (time.perf_counter() - t0) / steps
    return step


def _placeholders(model) -> tuple[int, ...]:
    """A transformers model's multimodal placeholder ids (the Omni thinker's image, video and
    audio tokens: its config's `*_token_id`), which a text prompt cannot hold; () for Qwen3-MoE."""
    cfg = model.config
    names = ("image_token_id", "video_token_id", "audio_token_id")
    return tuple(getattr(cfg, n) for n in names if isinstance(getattr(cfg, n, None), int))


def hf_generate_step_ms(model, batch: int, context: int, new: int = 16) -> float:
    """transformers `generate` decode step time, its prefill removed."""
    ids = random_ids(model.config.vocab_size, (batch, context), None, _placeholders(model)).to(model.device)

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
        random_ids(model.config.vocab_size, (tokens_per_seq,), g, _placeholders(model)).tolist()
        for _ in range(seqs)
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


def measure_engine_arm(
    llm, arm: str, batches, context: int, steps: int, generate_steps: int, bandwidth: float, log=print
) -> list[Row]:
    """The rows of one engine profile: per batch, the engine step and graph replay, and
    (with `generate_steps` > 0) decode and prefill through `LLM.generate`."""
    llm.set_numerics(arm)
    rows = []
    for b in batches:
        ms = engine_step_ms(llm, b, context, steps)
        row = Row(arm, b, context, ms, 1000 * b / ms, 1000 * step_bytes(llm.config, b, context) / bandwidth)
        row.replay_ms = replay_ms.get((arm, b))
        row.nominal_floor_ms, row.prefill_floor_tok_s = floors(llm.config, b, context, _device_name(llm))
        if generate_steps:
            gen = measure_generate(llm, b, context, extra=generate_steps)
            row.generate_ms, row.prefill_tok_s = gen.decode_ms, gen.prefill_tok_s
            row.generate_difference_ms = gen.difference_ms
        rows.append(row)
        log(
            f"{arm:>6} batch {b:>4}: generate {_ms(row.generate_ms)} ms/token, step {ms:.2f} ms, "
            f"graph replay {_ms(row.replay_ms)} ms, prefill {row.prefill_tok_s or 0:,.0f} tok/s"
        )
    return rows


def measure_rollout_arm(llm, arm: str, rollout: tuple[int, int, int], log=print) -> dict:
    """One rollout of R prompts x (P -> G) tokens through `generate` on profile `arm`."""
    llm.set_numerics(arm)
    r = measure_rollout(llm, *rollout)
    shape = f"{r.requests} x ({r.prompt_len} -> {r.new_tokens})"
    log(f"{arm:>6} rollout {shape}: {r.output_tok_s:,.0f} output tok/s")
    return {**r.__dict__, "output_tok_s": r.output_tok_s}


def engine_limits(
    batches,
    context: int,
    generate_steps: int,
    rollout: tuple[int, int, int] | None,
    max_num_batched_tokens: int | None = None,
) -> dict:
    """max_num_seqs and max_model_len that every engine measurement fits in (no preemption),
    and the step's token budget when one is given."""
    seqs = max((*batches, rollout[0] if rollout else 1))
    max_len = max(context + 16, rollout[1] + rollout[2] if rollout else 1)
    if generate_steps:  # the default budget is max(max_model_len, 2048 on the CPU, 8192 on CUDA):
        # the smaller one makes the longer prefill phase, so this bound holds on both
        budget = max_num_batched_tokens or max(max_len, 2048)
        max_len = max(max_len, generate_max_len(context, batches, generate_steps, budget))
    limits = {"max_num_seqs": seqs, "max_model_len": max_len}
    if max_num_batched_tokens is not None:
        limits["max_num_batched_tokens"] = max_num_batched_tokens
    return limits


def _device_name(llm) -> str:
    device = torch.device(llm.engine.device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _hf_rows(model, batches, context: int, bw: float, cfg: ModelConfig, log) -> list[Row]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, device_map="cuda").eval()
    rows = []
    for b in batches:
        with torch.inference_mode():
            ms = hf_generate_step_ms(hf, b, context)
        floor = 1000 * step_bytes(cfg, b, context) / bw
        rows.append(Row("transformers", b, context, ms, 1000 * b / ms, floor, generate_ms=ms))
        log(f"transformers batch {b:>4}: {ms:.2f} ms/step")
    del hf
    free_memory()
    return rows


def _trainer_ms(model, log) -> dict[str, float]:
    from samebits import trainer

    out = {}
    for name, impl, exact in (
        (EXACT_TRAINER, {}, True),
        (
            STOCK_TRAINER,
            {"experts_implementation": "grouped_mm", "attn_implementation": "sdpa", "samebits_forwards": False},
            False,
        ),
    ):
        m = trainer.load_hf_model(model, device="cuda", **impl)
        for n, p in m.named_parameters():  # experts frozen: their grads alone would not fit beside them
            p.requires_grad_("mlp.experts" not in n)
        m.train()
        out[name] = trainer_step_ms(m, exact=exact)
        log(f"trainer {name}: {out[name]:.1f} ms")
        del m
        free_memory()
    return out


def run(
    model: str | Path,
    batches=(1, 8, 32, 64, 256),
    context: int = 1024,
    arms=ARMS,
    hf_batches=None,
    steps: int = 20,
    generate_steps: int = 64,
    rollout: tuple[int, int, int] | None = (256, 1024, 1024),
    log=print,
    async_scheduling: bool | None = None,
    max_num_batched_tokens: int | None = None,
    on_progress=None,
) -> BenchResult:
    """Run the chosen arms on CUDA. `generate_steps`: decode steps timed through `generate`
    per point (0: none, nor prefill); `rollout`: (requests, prompt tokens, new tokens), run on
    each engine arm, or None; `async_scheduling`, `max_num_batched_tokens`: the engine's
    options (None: its defaults).
    `on_progress(result)`: called with the result so far after each arm's decode points, each
    rollout, transformers' points and the trainer's (the CLI writes bench.json then, so a run
    stopped part way keeps what it measured)."""
    progress = on_progress or (lambda result: None)
    from samebits.engine.llm import LLM

    if not torch.cuda.is_available():
        raise RuntimeError("samebits bench measures CUDA decode steps; no CUDA device is visible")
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    result = BenchResult(
        meta={"device": torch.cuda.get_device_name(dev), "copy_GBps": bw / 1e9, "model": str(model)}
    )
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s on {result.meta['device']}")
    engine_arms = [a for a in arms if a in PROFILES]
    if engine_arms:
        t0 = time.perf_counter()
        limits = engine_limits(batches, context, generate_steps, rollout, max_num_batched_tokens)
        # prefix caching off: a repeated prompt would skip its prefill in a timed call
        llm = LLM(
            model, device="cuda", async_scheduling=async_scheduling, enable_prefix_caching=False, **limits
        )
        result.meta["async_scheduling"] = llm.core.async_scheduling
        result.meta["max_num_batched_tokens"] = llm.engine.resolved_batched_tokens()
        log(f"engine built in {time.perf_counter() - t0:.0f} s")
        for arm in engine_arms:
            result.rows += measure_engine_arm(llm, arm, batches, context, steps, generate_steps, bw, log)
            result.meta["graph_replay_ms"] = {f"{a}/batch {b}": ms for (a, b), ms in replay_ms.items()}
            progress(result)
            if rollout:
                result.rollout[arm] = measure_rollout_arm(llm, arm, rollout, log)
                progress(result)
        del llm
        free_memory()
    if "hf" in arms:
        cfg = ModelConfig.from_pretrained(model)
        result.rows += _hf_rows(model, hf_batches or batches, context, bw, cfg, log)
        progress(result)
    if "trainer" in arms:
        result.trainer_ms = _trainer_ms(model, log)
        progress(result)
    return result
