"""`logprob_formula`: the sampled token's log-prob reported by a named trainer's line, bit for bit
(numerics/logprob_formulas.py, docs/logprobs.md).

Claims: in one batch mixing every formula and temperature, each row's reported log-prob equals
its formula applied to the HF trainer model's logits of the same tokens under
`batch_invariant()`; the engine-wide default (`LLM(logprob_formula=)`) is taken by requests that
name none; the `trl` and `trl_selective` lines equal TRL's own code where TRL is installed; an
unknown name is refused. At Qwen's vocabulary width (151,936 columns, five TRL tiles) `trl` is
TRL's `ChunkedLogProbFunction` bit for bit, and TRL's own tile GEMMs run batch-invariant under
`batch_invariant()` (a sequence alone = packed among others, log-probs and hidden gradients).
Controls: the pairs of lines that are claimed to differ do differ, for
the reason claimed, on rows where the rounding can show.
"""

from __future__ import annotations

import pytest
import torch

from samebits import LLM, SamplingParams, batch_invariant, trainer
from samebits.numerics import logprob_formulas as lf

TEMPS = (0.7, 1.0, 1.3)
MAX_TOKENS = 6


def _rows(n: int = 8, vocab: int = 8256, seed: int = 0, scale: float = 4.0) -> tuple[torch.Tensor, ...]:
    """bf16 logits [n, vocab] as a model gives, and a token per row."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * scale).bfloat16()
    return logits, torch.randint(0, vocab, (n,), generator=g)


def _line(name: str, logits: torch.Tensor, ids: torch.Tensor, t: float) -> torch.Tensor:
    """The line on the logits' device, brought to the CPU (where the engine's outputs are)."""
    temps = torch.full(ids.shape, t, dtype=torch.float32, device=logits.device)
    return lf.LINES[name](logits, ids, temps).cpu()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def mixed(tiny, request):
    """One batch: every formula at every temperature (18 requests), the engine's outputs and the
    HF trainer model, on CPU and on CUDA (the Triton kernels, temperature by the reciprocal)."""
    device = request.param
    llm = LLM(tiny, device=device, dtype="bfloat16", max_num_seqs=18, max_model_len=64)
    cases = [(f, t) for f in lf.FORMULAS for t in TEMPS]
    prompts = [[3 + i % 7, 5 + i % 11, 2 + i % 5, 9][: 2 + i % 3] for i in range(len(cases))]
    params = [
        SamplingParams(temperature=t, max_tokens=MAX_TOKENS, ignore_eos=True, seed=11 + i, logprob_formula=f)
        for i, (f, t) in enumerate(cases)
    ]
    outs = llm.generate(prompts, params)
    del llm
    model = trainer.load_hf_model(tiny, dtype=torch.bfloat16, device=device)
    return cases, outs, model


def _hf_logits(model, out) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's logits at the positions that predicted the sampled tokens, and those tokens."""
    ids = torch.tensor(out.prompt_token_ids + out.token_ids, device=model.device)
    p = len(out.prompt_token_ids)
    with batch_invariant(), torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
    return logits[p - 1 : -1], ids[p:]


def test_mixed_batch_each_row_equals_its_formula_on_the_hf_logits(mixed):
    cases, outs, model = mixed
    for (formula, t), out in zip(cases, outs, strict=True):
        assert len(out.token_ids) == MAX_TOKENS
        logits, ids = _hf_logits(model, out)
        with batch_invariant():
            want = _line(formula, logits, ids, t)
        assert want.dtype == torch.float32 and out.logprobs.dtype == torch.float32
        assert torch.equal(out.logprobs, want), (formula, t, out.logprobs, want)


def test_control_engine_rows_are_not_the_default_line(mixed):
    # The claim above could pass if the engine ignored the field and every line gave the default's
    # bits on the tiny model. It doesn't: each non-default row set, read by the default line
    # instead, differs somewhere (cross_entropy excepted: its bits are log_softmax's).
    cases, outs, model = mixed
    for formula in lf.FORMULAS:
        if formula in ("log_softmax", "cross_entropy"):
            continue
        got, default = [], []
        for (f, t), out in zip(cases, outs, strict=True):
            if f == formula:
                logits, ids = _hf_logits(model, out)
                with batch_invariant():
                    default.append(_line("log_softmax", logits, ids, t))
                got.append(out.logprobs)
        assert not torch.equal(torch.cat(got), torch.cat(default)), formula


def test_default_log_softmax_line_is_the_plain_trainer_line(mixed):
    # the `log_softmax` line written out as a trainer writes it, no samebits helper
    cases, outs, model = mixed
    for (formula, t), out in zip(cases, outs, strict=True):
        if formula != "log_softmax":
            continue
        logits, ids = _hf_logits(model, out)
        with batch_invariant():
            want = torch.log_softmax(logits.float() / t, dim=-1).gather(-1, ids[:, None])[:, 0].cpu()
        assert torch.equal(out.logprobs, want), t


def test_engine_wide_formula_is_taken_by_requests_that_name_none(tiny):
    llm = LLM(tiny, device="cpu", dtype="bfloat16", max_num_seqs=4, max_model_len=64, logprob_formula="trl")
    params = [
        SamplingParams(temperature=t, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3 + i, logprob_formula=f)
        for i, (t, f) in enumerate([(0.7, None), (1.3, None), (1.3, "verl"), (1.0, None)])
    ]
    outs = llm.generate([[5, 9, 11], [8, 6], [3, 3, 7], [10, 12, 4]], params)
    model = trainer.load_hf_model(tiny, dtype=torch.bfloat16)
    for out, sp in zip(outs, params, strict=True):
        logits, ids = _hf_logits(model, out)
        with batch_invariant():
            want = _line(sp.logprob_formula or "trl", logits, ids, sp.temperature)
        assert torch.equal(out.logprobs, want), sp


def test_mixed_rows_in_one_call_equal_each_row_alone():
    # token_logprobs over rows of different formulas and temperatures = each row by its line alone
    logits, ids = _rows(12)
    formulas = [lf.FORMULAS[i % len(lf.FORMULAS)] for i in range(12)]
    temps = [TEMPS[i % 3] for i in range(12)]
    with batch_invariant():
        got = lf.token_logprobs(logits, ids, temps, formulas)
        pairs = enumerate(zip(formulas, temps, strict=True))
        alone = torch.cat([_line(f, logits[i : i + 1], ids[i : i + 1], t) for i, (f, t) in pairs])
    assert torch.equal(got, alone)


# --- controls: the lines claimed to differ do, for the reason claimed -------------------------


@pytest.mark.parametrize("t", [0.7, 1.3])
def test_control_trl_multiply_by_inverse_differs_from_divide(t):
    # `trl`: z * float32(1 / T); `log_softmax`: z / T. Only the temperature's rounding differs.
    logits, ids = _rows(64)
    with batch_invariant():
        a, b = _line("trl", logits, ids, t), _line("log_softmax", logits, ids, t)
    assert not torch.equal(a, b), t


@pytest.mark.parametrize("name", ["trl_selective", "verl"])
@pytest.mark.parametrize("t", [0.7, 1.0, 1.3])
def test_control_bf16_branch_differs_from_float32_line(name, t):
    # bf16 logits take the bf16 log_softmax branch (bf16 result widened): differs from the same
    # line on the float32 logits (the fp32 `gather - logsumexp` branch).
    logits, ids = _rows(64)
    with batch_invariant():
        low = _line(name, logits, ids, t)
        high = _line(name, logits.float(), ids, t)
    assert not torch.equal(low, high), (name, t)
    assert torch.equal(low, low.bfloat16().float())  # a bf16 value, widened


def test_control_verl_rounds_temperature_to_bf16():
    # verl divides by T rounded to the logits' dtype; trl_selective by the Python float, then
    # rounds the quotient: at T = 1.3 (not a bf16 value) they differ, at T = 1 they are the same.
    logits, ids = _rows(64)
    with batch_invariant():
        assert not torch.equal(_line("verl", logits, ids, 1.3), _line("trl_selective", logits, ids, 1.3))
        assert torch.equal(_line("verl", logits, ids, 1.0), _line("trl_selective", logits, ids, 1.0))


def test_control_logsumexp_differs_from_log_softmax():
    # `z[id] - logsumexp(z)` vs aten's log_softmax: a different reduction (log of the sum of exp
    # after the max vs log_softmax's own); seen to differ at 0.7 and 1.3 on these rows.
    logits, ids = _rows(64)
    with batch_invariant():
        for t in (0.7, 1.3):
            assert not torch.equal(_line("logsumexp", logits, ids, t), _line("log_softmax", logits, ids, t)), t


def test_cross_entropy_is_log_softmax():
    # No control for this pair: aten decomposes cross_entropy into log_softmax and a gather, so
    # `cross_entropy` and `log_softmax` are the same bits at every temperature (a claim, not a
    # control). The control with teeth for `cross_entropy` is its difference from `logsumexp`.
    logits, ids = _rows(64)
    with batch_invariant():
        for t in TEMPS:
            ce = _line("cross_entropy", logits, ids, t)
            assert torch.equal(ce, _line("log_softmax", logits, ids, t)), t
        assert not torch.equal(_line("cross_entropy", logits, ids, 1.3), _line("logsumexp", logits, ids, 1.3))


# --- TRL's own code (TRL is not in CI's venv) ------------------------------------------------


def test_trl_line_equals_trls_chunked_logprob_function():
    pytest.importorskip("trl")
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    # vocabulary past one TRL_VOCAB_TILE, so the running max/sum folds two tiles
    vocab, hidden_size, n = lf.TRL_VOCAB_TILE + 1000, 64, 6
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, hidden_size, generator=g).bfloat16()
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.5).bfloat16()
    ids = torch.tensor([0, 5, lf.TRL_VOCAB_TILE - 1, lf.TRL_VOCAB_TILE, vocab - 1, 777])
    with batch_invariant(), torch.no_grad():
        logits = hidden @ weight.t()
        for t in TEMPS:
            args = (hidden, weight, None, ids, t, lf.TRL_VOCAB_TILE, None, 1.0, ())
            theirs = ChunkedLogProbFunction.apply(*args)[0]
            assert torch.equal(_line("trl", logits, ids, t), theirs), t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_trl_selective_line_equals_trls_selective_log_softmax(dtype):
    pytest.importorskip("trl")
    from trl.trainer.utils import selective_log_softmax

    logits, ids = _rows(16)
    logits = logits.to(dtype)
    with batch_invariant():
        for t in TEMPS:
            theirs = selective_log_softmax(logits, ids, temperature=t).float()
            assert torch.equal(_line("trl_selective", logits, ids, t), theirs), (dtype, t)


# --- refusals -----------------------------------------------------------------------------------


def test_unknown_formula_is_refused_naming_the_allowed_values(tiny):
    with pytest.raises(ValueError, match="logprob_formula must be one of") as e:
        LLM(tiny, device="cpu", dtype="bfloat16", logprob_formula="trl_fused")
    for name in lf.FORMULAS:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="logprob_formula must be one of"):
        SamplingParams(logprob_formula="openrlhf")


# --- at Qwen's vocabulary width: several TRL tiles, so the fold order matters ------------------

QWEN_VOCAB = 151_936  # Qwen3-MoE's lm_head rows: 4 tiles of 32768 and one of 20864
PIECES = ((0, 1), (1, 4), (4, 11), (11, 40))  # sequences of 1, 3, 7 and 29 tokens, packed in that order


@pytest.fixture(scope="module")
def qwen_width():
    """hidden [40, 128] and an LM head [151936, 128] (logits of a few units, where rounding reaches
    the log-prob), fp32 masters; tokens at the tiles' edges among random ones."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(40, 128, generator=g)
    weight = torch.randn(QWEN_VOCAB, 128, generator=g) * 0.35
    edges = [0, lf.TRL_VOCAB_TILE - 1, lf.TRL_VOCAB_TILE, 4 * lf.TRL_VOCAB_TILE, QWEN_VOCAB - 1]
    ids = torch.cat([torch.tensor(edges), torch.randint(0, QWEN_VOCAB, (35,), generator=g)])
    return hidden, weight, ids


def _trls(hidden, weight, ids, t: float, grad: bool = False):
    """TRL 1.16.0's own fused-head line, `ChunkedLogProbFunction` (what `add_fused_lm_head` runs),
    -> (log-probs [n], d(sum log-probs)/d hidden [n, H] when `grad`)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    hidden = hidden.detach().clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        lps = ChunkedLogProbFunction.apply(hidden, weight, None, ids, t, lf.TRL_VOCAB_TILE, None, 1.0, ())[0]
        if grad:
            lps.sum().backward()
    return lps.detach(), hidden.grad


@pytest.mark.parametrize("t", TEMPS)
def test_trl_line_equals_trls_function_at_qwen_vocab_width(qwen_width, t):
    pytest.importorskip("trl")
    hidden, weight, ids = (x.bfloat16() if x.is_floating_point() else x for x in qwen_width)
    with batch_invariant(), torch.no_grad():
        logits = hidden @ weight.t()  # the engine's LM head: [40, 151936] bf16
        theirs = _trls(hidden, weight, ids, t)[0]
        assert torch.equal(_line("trl", logits, ids, t), theirs), t
        # control, the neighbour a TRL user gets by default: `log_softmax` (a divide by T, aten's
        # reduction) mismatches at every temperature here
        assert not torch.equal(_line("log_softmax", logits, ids, t), theirs), t


def test_control_trl_fold_in_one_tile_mismatches_trls_at_qwen_vocab_width(qwen_width, monkeypatch):
    # What the width tests: folding the 151,936 columns as one tile (the running max and sum
    # rescaled once, not per tile) gives other bits than TRL's five tiles at some temperature.
    pytest.importorskip("trl")
    hidden, weight, ids = (x.bfloat16() if x.is_floating_point() else x for x in qwen_width)
    with batch_invariant(), torch.no_grad():
        logits = hidden @ weight.t()
        theirs = {t: _trls(hidden, weight, ids, t)[0] for t in TEMPS}
        monkeypatch.setattr(lf, "TRL_VOCAB_TILE", QWEN_VOCAB)
        one_tile = {t: _line("trl", logits, ids, t) for t in TEMPS}
    assert any(not torch.equal(one_tile[t], theirs[t]) for t in TEMPS)


def _alone_and_packed(hidden, weight, ids, grad: bool):
    """TRL's log-probs (and hidden gradients) of each sequence of PIECES alone, and of all of them
    packed in one call, at T = 0.7."""
    packed = _trls(hidden, weight, ids, 0.7, grad)
    parts = [_trls(hidden[a:b], weight, ids[a:b], 0.7, grad) for a, b in PIECES]
    alone = tuple(torch.cat([p[i] for p in parts]) if grad or i == 0 else None for i in range(2))
    return alone, packed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_trls_tile_gemm_is_batch_invariant_under_batch_invariant(qwen_width, dtype):
    # TRL's own function: the forward's `torch.mm(..., out=tile)` and the backward's
    # `addmm_` (`_addmm_fp32` off CUDA) run samebits' kernels under batch_invariant(), so a
    # sequence alone and packed among others gives the same log-probs and hidden gradients.
    pytest.importorskip("trl")
    hidden, weight, ids = (x.to(dtype) if x.is_floating_point() else x for x in qwen_width)
    with batch_invariant():
        (alone, d_alone), (packed, d_packed) = _alone_and_packed(hidden, weight, ids, grad=True)
    assert torch.equal(alone, packed)
    assert torch.equal(d_alone, d_packed)


def test_control_stock_tile_gemm_depends_on_the_packing(qwen_width):
    # The same comparison outside batch_invariant() fails, from the GEMMs' dependence on the
    # number of rows. On the CPU this was measured with oneDNN's bf16 GEMM row-invariant for the
    # row counts here (the bf16 forward log-probs came out equal alone and packed: no control can
    # show it there), while MKL's fp32 GEMM is not: fp32 TRL (an fp32 model) differs in its
    # log-probs, and bf16 TRL in its hidden gradients, whose `addmm_` runs in fp32 on the CPU.
    pytest.importorskip("trl")
    hidden, weight, ids = qwen_width
    (alone, _), (packed, _) = _alone_and_packed(hidden, weight, ids, grad=False)
    assert not torch.equal(alone, packed)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    (_, d_alone), (_, d_packed) = _alone_and_packed(hidden, weight, ids, grad=True)
    assert not torch.equal(d_alone, d_packed)


@pytest.mark.gpu
def test_trl_selective_on_cuda_is_trls_selective_log_softmax():
    # the engine calls TRL's fused kernel from trl.kernels; TRL's public helper takes the same
    # branch for these rows. Control: the CPU line (TRL's torch fallback) is not those bits.
    pytest.importorskip("trl.trainer.utils", reason="TRL's helper needs pandas and datasets")
    from trl.trainer.utils import selective_log_softmax

    logits, ids = _rows(16)
    logits, ids = logits.cuda(), ids.cuda()
    with batch_invariant():
        for t in TEMPS:
            ours = lf.trl_selective_cuda(logits, ids, t).float()
            assert torch.equal(ours, selective_log_softmax(logits, ids, temperature=t).float()), t
        cpu = _line("trl_selective", logits.cpu(), ids.cpu(), 1.3)
    assert not torch.equal(lf.trl_selective_cuda(logits, ids, 1.3).float().cpu(), cpu)
