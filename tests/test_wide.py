"""Batch invariance at a released model's widths, where stock kernels do depend on the batch.

At the tiny models' widths (hidden <= 96) stock CPU bf16 GEMMs give a row the same bits
at every M, so a comparison there cannot fail for a batching reason. This file builds one
decoder layer of Qwen3-30B-A3B's shape (hidden 2048, 128 experts top-8, expert
intermediate 768, 32 query / 4 kv heads of 128) with a vocabulary of 8256 (past the 8192
columns one block of the CUDA tree sum reduces), as a sharded HF checkpoint directory read
by the real loaders, once per session.

Claims, bitwise: a request alone = in a batch = with chunked prefill = after preemption
(engine), and the trainer's recompute, packed or one sequence at a time, = the engine.
Controls, the same comparisons on stock kernels (the `fast` profile; the trainer outside
`batch_invariant()`), must differ: the reason each claim is about is the batch.
"""

from __future__ import annotations

import pytest
import torch
from cpu_facts import needs_varying_stock_bf16

from samebits import LLM, SamplingParams, batch_invariant, trainer
from samebits.model.qwen3_moe.loader import load_state_dict, save_tensor_stream
from samebits.trainer import forwards
from samebits.verify import make_prompts

HIDDEN, EXPERTS, TOP_K, MOE_INTER = 2048, 128, 8, 768
HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4, 128, 8256
PROMPT_LENS = (9, 21, 4, 14)
MAX_TOKENS = 6


def _config() -> dict:
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        mlp_only_layers=[],
        intermediate_size=6144,
        moe_intermediate_size=MOE_INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        max_position_embeddings=256,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        eos_token_id=1,
        bos_token_id=0,
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg.to_dict() | {"dtype": "bfloat16"}


def _tensors(seed: int):
    """(HF name, bf16 tensor) of one sparse layer. Linear weights have std 1/sqrt(fan_in), so
    activations stay O(1) at this width; the head's 3/sqrt(H) spreads the next-token
    distribution (log-probs of a few units, not saturated at 0)."""
    g = torch.Generator().manual_seed(seed)

    def dense(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * (gain * cols**-0.5)).bfloat16()

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=g)).bfloat16()

    p = "model.layers.0."
    yield "model.embed_tokens.weight", torch.randn(VOCAB, HIDDEN, generator=g).bfloat16()
    yield p + "input_layernorm.weight", norm(HIDDEN)
    yield p + "post_attention_layernorm.weight", norm(HIDDEN)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for name, (rows, cols) in {
        "q": (q, HIDDEN),
        "k": (kv, HIDDEN),
        "v": (kv, HIDDEN),
        "o": (HIDDEN, q),
    }.items():
        yield f"{p}self_attn.{name}_proj.weight", dense(rows, cols)
    yield p + "self_attn.q_norm.weight", norm(HEAD_DIM)
    yield p + "self_attn.k_norm.weight", norm(HEAD_DIM)
    yield p + "mlp.gate.weight", dense(EXPERTS, HIDDEN, 2.0)
    yield p + "mlp.experts.gate_up_proj", torch.stack([dense(2 * MOE_INTER, HIDDEN) for _ in range(EXPERTS)])
    yield p + "mlp.experts.down_proj", torch.stack([dense(HIDDEN, MOE_INTER) for _ in range(EXPERTS)])
    yield "model.norm.weight", norm(HIDDEN)
    yield "lm_head.weight", dense(VOCAB, HIDDEN, 3.0)


@pytest.fixture(scope="session")
def wide(tmp_path_factory):
    """The checkpoint directory: config.json, 3 shards of <= 512 MiB and their index (1.3 GB)."""
    return save_tensor_stream(_config(), _tensors(seed=0), tmp_path_factory.mktemp("wide"), 1 << 29)


@pytest.fixture(scope="module")
def weights(wide):
    """One bf16 copy of the weights, shared by every engine below (`LLM(weights=...)`)."""
    return load_state_dict(wide, dtype=torch.bfloat16)[1]


def _engine(wide, weights, numerics="exact", max_model_len=32, **kw) -> LLM:
    return LLM(
        wide, weights=weights.items(), numerics=numerics, max_num_seqs=4, max_model_len=max_model_len, **kw
    )


def _requests(max_tokens: int = MAX_TOKENS):
    prompts = make_prompts(PROMPT_LENS, VOCAB, seed=3)
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i) for i in range(4)]
    return prompts, params


def _runs(wide, weights, numerics, **kw):
    """The four schedules of the same requests: batched, each alone, chunked, preempted."""
    prompts, params = _requests()
    batched = _engine(wide, weights, numerics, **kw).generate(prompts, params)
    alone = [
        _engine(wide, weights, numerics, **kw).generate([p], [s])[0]
        for p, s in zip(prompts, params, strict=True)
    ]
    chunked = _engine(wide, weights, numerics, max_num_batched_tokens=8, **kw).generate(prompts, params)
    # 4 blocks of 8 slots: the 27-token request needs all 4, so the others are preempted
    preempted = _engine(wide, weights, numerics, block_size=8, num_blocks=4, **kw).generate(prompts, params)
    assert sum(o.num_preemptions for o in preempted) > 0
    return batched, {"alone": alone, "chunked": chunked, "preempted": preempted}


def _mismatches(a, b) -> int:
    """Positions where two runs' sampled token or log-prob bits differ (over the common length)."""
    n = 0
    for x, y in zip(a, b, strict=True):
        for i in range(min(len(x.token_ids), len(y.token_ids))):
            same_bits = x.logprobs[i].view(torch.int32) == y.logprobs[i].view(torch.int32)
            n += x.token_ids[i] != y.token_ids[i] or not bool(same_bits)
    return n


@pytest.fixture(scope="module")
def exact(wide, weights):
    return _runs(wide, weights, "exact")


def test_wide_engine_alone_batched_chunked_preempted_bitwise(exact):
    batched, others = exact
    assert all(len(o.token_ids) == MAX_TOKENS for o in batched)
    for name, outs in others.items():
        assert [o.token_ids for o in outs] == [o.token_ids for o in batched], name
        for x, y in zip(outs, batched, strict=True):
            assert torch.equal(x.logprobs, y.logprobs), name


@needs_varying_stock_bf16
def test_wide_control_fast_profile_depends_on_the_schedule(wide, weights):
    """The same four schedules on stock kernels (stock GEMMs and experts) give other bits."""
    batched, others = _runs(wide, weights, "fast")
    for name, outs in others.items():
        assert _mismatches(outs, batched) > 0, f"stock kernels gave {name} = batched: no batching effect"


def _recompute(model, outs, packed: bool) -> list[torch.Tensor]:
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    return trainer.token_logprobs(model, seqs, [len(o.prompt_token_ids) for o in outs], packed=packed)


def test_wide_trainer_packed_and_one_at_a_time_equal_the_engine(wide, exact):
    batched, _ = exact
    model = trainer.load_hf_model(wide, dtype=torch.bfloat16)
    with batch_invariant():
        for packed in (True, False):
            lps = _recompute(model, batched, packed)
            for out, lp in zip(batched, lps, strict=True):
                assert torch.equal(out.logprobs, lp), (packed, (out.logprobs != lp).sum())
    assert any(isinstance(m, forwards._Swapped) for m in model.modules())  # samebits' forwards ran


@needs_varying_stock_bf16
def test_wide_control_trainer_forwards_on_stock_gemms_depend_on_packing(wide, exact, monkeypatch):
    """The trainer's swapped linears (`trainer/forwards.py`) with a stock GEMM in place of the
    row-invariant matmul: at this width the packed recompute (M ~ 80 rows) then differs from one
    sequence at a time, so the equality above holds because of the matmul the swap calls."""
    batched, _ = exact
    model = trainer.load_hf_model(wide, dtype=torch.bfloat16)

    def stock_mm(x, w):  # mm's out= overload is not overridden: MKL as it is
        a = x.reshape(-1, x.shape[-1])
        return torch.mm(a, w.t(), out=a.new_empty(a.shape[0], w.shape[0])).view(*x.shape[:-1], -1)

    monkeypatch.setattr(forwards, "_matmul", stock_mm)
    with batch_invariant():
        packed, single = _recompute(model, batched, True), _recompute(model, batched, False)
    assert any(not torch.equal(a, b) for a, b in zip(packed, single, strict=True))


@pytest.mark.gpu
def test_wide_on_cuda_schedules_and_the_trainer_agree(wide, weights, monkeypatch):
    """On CUDA at head_dim 128 the engine's decode attention runs in transposed 16-row tiles
    with split keys, its prefill and the trainer in 64-row tiles, with cuBLAS nowhere: the
    four schedules, and the trainer's recompute of 8 copies of the batch packed in one row
    (~600 rows), give the same bits. Controls: (1) the same recompute on stock GEMMs (outside
    `batch_invariant()`) differs from one sequence at a time: at ~600 rows cuBLAS's rows
    depend on M (`test_negative_control_cublas_rows_depend_on_m`); (2) with the row sums of p
    taken by `tl.sum`, whose order follows each tile orientation's register layout, the
    engine's transposed decode no longer gives the trainer's bits."""
    from functools import partial

    from samebits.kernels import attention_launch as at

    paths, real_plan = set(), at.plan

    def recording(*args, **kwargs):
        path = real_plan(*args, **kwargs)
        paths.add((path.transposed, path.split))
        return path

    monkeypatch.setattr(at, "plan", recording)
    weights = {name: t.to("cuda") for name, t in weights.items()}
    batched, others = _runs(wide, weights, "exact", device="cuda")
    assert (True, True) in paths and any(not t for t, _ in paths), paths  # both orientations ran
    for name, outs in others.items():
        assert _mismatches(outs, batched) == 0, name
    model = trainer.load_hf_model(wide, device="cuda", dtype=torch.bfloat16)
    with batch_invariant():
        lps = _recompute(model, batched * 8, packed=True)
    for out, lp in zip(batched * 8, lps, strict=True):
        assert torch.equal(out.logprobs, lp.cpu())
    stock_packed, stock_single = _recompute(model, batched * 8, True), _recompute(model, batched, False)
    assert any(not torch.equal(a, b) for a, b in zip(stock_packed, stock_single * 8, strict=True))
    # A row sum's order changes l by an ulp, and an ulp of l flips a bf16 output element's
    # rounding about once in 2^16: the control decodes 4 x 200 tokens (~3M elements of o), and
    # the same long decode with the row sums by MMA gives the trainer's bits
    prompts, params = _requests(max_tokens=200)

    def long_decode_equals_the_trainer() -> bool:
        outs = _engine(wide, weights, max_model_len=224, device="cuda").generate(prompts, params)
        with batch_invariant():
            lps = _recompute(model, outs, packed=True)
        return all(torch.equal(o.logprobs, lp.cpu()) for o, lp in zip(outs, lps, strict=True))

    assert long_decode_equals_the_trainer()
    monkeypatch.setattr(at, "attention", partial(at.attention, l_by_mma=False))
    assert not long_decode_equals_the_trainer()


@needs_varying_stock_bf16
@pytest.mark.parametrize("experts", ["samebits", "grouped_mm"])
def test_wide_control_trainer_without_batch_invariant_packing_changes_bits(wide, exact, experts):
    """Outside `batch_invariant()` the trainer's GEMMs are stock (with samebits' experts and
    attention: only the aten overrides removed; with grouped_mm: all stock): packing the
    sequences into one row changes M, and so the bits."""
    batched, _ = exact
    model = trainer.load_hf_model(wide, dtype=torch.bfloat16, experts_implementation=experts)
    packed, single = _recompute(model, batched, True), _recompute(model, batched, False)
    assert any(not torch.equal(a, b) for a, b in zip(packed, single, strict=True))


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_wide_engine_equals_the_trainer_line_at_temperature(wide, weights, temperature):
    """Engine log-probs at T = `temperature` = `torch.log_softmax(logits.float() / T, dim=-1)`
    on the transformers model's packed logits, T a Python float, under batch_invariant().
    Control: the same line with 1 / float32(T) multiplied in (CUDA's rounding) differs."""
    prompts, _ = _requests()
    params = [
        SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i)
        for i in range(4)
    ]
    outs = _engine(wide, weights).generate(prompts, params)
    model = trainer.load_hf_model(wide, dtype=torch.bfloat16)
    ids = torch.tensor([t for o in outs for t in o.prompt_token_ids + o.token_ids])
    pos = torch.cat([torch.arange(len(o.prompt_token_ids) + len(o.token_ids)) for o in outs])
    with batch_invariant(), torch.no_grad():
        logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
        line = torch.log_softmax(logits.float() / temperature, dim=-1)
        recip = torch.log_softmax(logits.float() * (1 / torch.tensor(temperature)), dim=-1)
    start, differs = 0, 0
    for o in outs:
        p, n = len(o.prompt_token_ids), len(o.prompt_token_ids) + len(o.token_ids)
        rows, targets = slice(start + p - 1, start + n - 1), ids[start + p : start + n, None]
        assert torch.equal(line[rows].gather(-1, targets)[:, 0], o.logprobs)
        differs += int(not torch.equal(recip[rows].gather(-1, targets)[:, 0], o.logprobs))
        start += n
    assert differs > 0, "the control could not see 1 / T's rounding"


def _n4_runs(wide, weights, numerics):
    """n=4 of a 17-token prompt, twice: (1) with prefix sharing, after a first request for the
    same prompt, so every sample takes the first block from the cache and computes 1 token
    (a step of 4 rows); (2) without sharing (a step of 4 x 17 rows)."""
    prompt = make_prompts([17], VOCAB, seed=5)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0, n=4)
    llm = _engine(wide, weights, numerics)
    llm.generate([prompt], SamplingParams(max_tokens=1, seed=9))
    shared = llm.generate([prompt], sp)[0].outputs
    assert llm.core.stats.prefix_cache_hits == 4 * 16
    plain = _engine(wide, weights, numerics, enable_prefix_caching=False).generate([prompt], sp)[0].outputs
    return shared, plain


def test_wide_n4_prefix_sharing_is_bitwise(wide, weights):
    """The n=4 samples share the prompt's blocks, computed by the first sample in the same
    step (21 tokens: 21 + 3 x 5 rows instead of 4 x 21) or by an earlier request: the same
    bits as without sharing."""
    prompt = make_prompts([21], VOCAB, seed=6)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=1, n=4)
    llm = _engine(wide, weights)
    same_step = llm.generate([prompt], sp)[0].outputs
    assert llm.core.stats.prefix_cache_hits == 3 * 16
    plain = _engine(wide, weights, enable_prefix_caching=False).generate([prompt], sp)[0].outputs
    assert _mismatches(same_step, plain) == 0
    assert _mismatches(*_n4_runs(wide, weights, "exact")) == 0


@needs_varying_stock_bf16
def test_wide_control_fast_profile_prefix_sharing_changes_bits(wide, weights):
    """On stock kernels the 4-row step gives other bits than the 68-row one."""
    assert _mismatches(*_n4_runs(wide, weights, "fast")) > 0
