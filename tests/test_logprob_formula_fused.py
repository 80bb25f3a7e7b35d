"""`logprob_formula=FusedLine(fn)`: a user's own fused line, computed from the final hidden states
and the LM head (issue 42 item 3; requests/sampling_params.py, numerics/logprob_formulas.py,
docs/logprobs.md).

Claims: an engine given `FusedLine(fn)` (engine-wide or per request, beside named formulas in one
batch) reports, for every sampled token and every top-k entry, `fn` on the HF trainer model's own
final hidden states and LM head weight, bit for bit under `batch_invariant()`; TRL's fused head
given that way is the engine's named `trl` line. At construction a fused line that is not
row-invariant is refused by name. Controls: the default line on the same tokens differs; a line
that depends on the other rows of its batch is refused; what cannot run (processed_logprobs, a
call without the hidden states, a non-callable) is refused with a message.
"""

from __future__ import annotations

import pytest
import torch
from hf_rows import hf_rows

from samebits import LLM, SamplingParams, batch_invariant, trainer
from samebits.numerics import logprob_formulas as lf
from samebits.requests import FusedLine

MAX_TOKENS = 5


def trl_fused_head(hidden, weight, ids, t):
    """TRL 1.16.0's fused-head line, what `add_fused_lm_head(model, temperature=t)` runs. Its
    Triton kernel reads the targets at stride 1 (TRL passes `labels[mask]`, a contiguous copy),
    so a column of an [n, k] id table goes in contiguous, as TRL's own would."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    targets = ids.contiguous()
    return ChunkedLogProbFunction.apply(hidden, weight, None, targets, t, lf.TRL_VOCAB_TILE, None, 1.0, ())[0]


def projected_log_softmax(hidden, weight, ids, t):
    """A user's plain fused line: project in the model's dtype, log_softmax in fp32 at T."""
    logits = hidden @ weight.t()
    return torch.log_softmax(logits.float() * (1 / t), dim=-1).gather(-1, ids[:, None])[:, 0]


def batch_centred(hidden, weight, ids, t):
    """Not row-invariant: each row is centred by the batch's mean hidden state."""
    return projected_log_softmax(hidden - hidden.mean(0, keepdim=True), weight, ids, t)


# (temperature, formula, logprobs): None takes the engine's FusedLine(trl_fused_head)
CASES = [
    (0.7, None, 3),
    (1.3, None, None),
    (0.0, None, 3),
    (1.0, None, None),
    (1.3, "verl", 2),
    (0.7, FusedLine(projected_log_softmax), 3),
    (1.3, FusedLine(projected_log_softmax), None),
]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def fused_run(tiny, request):
    pytest.importorskip("trl")
    device = request.param
    llm = LLM(tiny, device=device, max_num_seqs=len(CASES), max_model_len=64,
              logprob_formula=FusedLine(trl_fused_head))  # fmt: skip
    params = [
        SamplingParams(temperature=t, logprob_formula=f, logprobs=k, max_tokens=MAX_TOKENS, ignore_eos=True,
                       seed=80 + i)
        for i, (t, f, k) in enumerate(CASES)
    ]  # fmt: skip
    prompts = [[3 + i % 5, 8, 2 + i % 3, 11][: 2 + i % 3] for i in range(len(CASES))]
    outs = llm.generate(prompts, params)
    del llm
    return outs, trainer.load_hf_model(tiny, dtype=torch.bfloat16, device=device)


def _fn(formula):
    return trl_fused_head if formula is None else formula.fn


def test_fused_rows_are_the_users_fn_on_the_trainers_hidden_states(fused_run):
    outs, model = fused_run
    weight = model.lm_head.weight
    for (t, formula, k), out in zip(CASES, outs, strict=True):
        if formula == "verl":
            continue
        hidden, _, tokens = hf_rows(model, out)
        fn, temp = _fn(formula), t or 1.0
        with batch_invariant(), torch.no_grad():
            assert torch.equal(out.logprobs, fn(hidden, weight, tokens, temp).float().cpu()), (t, formula)
            if k:
                ids = torch.tensor([[tok for tok, _ in s] for s in out.top_logprobs], device=hidden.device)
                values = torch.tensor([[v for _, v in s] for s in out.top_logprobs])
                for j in range(k):
                    assert torch.equal(values[:, j], fn(hidden, weight, ids[:, j], temp).float().cpu()), (t, j)


def test_named_formula_rows_beside_fused_rows_keep_their_line(fused_run):
    outs, model = fused_run
    for (t, formula, _), out in zip(CASES, outs, strict=True):
        if formula == "verl":
            _, logits, tokens = hf_rows(model, out)
            with batch_invariant():
                temps = torch.full(tokens.shape, t, dtype=torch.float32, device=logits.device)
                assert torch.equal(out.logprobs, lf.LINES["verl"](logits, tokens, temps).cpu())


def test_trls_fused_head_given_as_a_fused_line_is_the_named_trl_line(fused_run):
    outs, model = fused_run
    for (t, formula, _), out in zip(CASES, outs, strict=True):
        if formula is None:
            _, logits, tokens = hf_rows(model, out)
            with batch_invariant():
                temps = torch.full(tokens.shape, t or 1.0, dtype=torch.float32, device=logits.device)
                assert torch.equal(out.logprobs, lf.LINES["trl"](logits, tokens, temps).cpu()), t


def test_control_the_default_line_on_the_same_tokens_differs(fused_run):
    outs, model = fused_run
    got, default = [], []
    for (t, formula, _), out in zip(CASES, outs, strict=True):
        if formula is None or isinstance(formula, FusedLine):
            _, logits, tokens = hf_rows(model, out)
            with batch_invariant():
                lps = torch.log_softmax(logits.float() / (t or 1.0), -1)
            default.append(lps.gather(-1, tokens[:, None])[:, 0])
            got.append(out.logprobs)
    assert not torch.equal(torch.cat(got), torch.cat(default).cpu())


# --- refusals -------------------------------------------------------------------------------------


def test_control_a_fused_line_that_reads_other_rows_is_refused_by_name(tiny):
    with pytest.raises(ValueError, match="FusedLine\\(batch_centred\\) is not row-invariant"):
        LLM(tiny, max_model_len=64, logprob_formula=FusedLine(batch_centred))
    llm = LLM(tiny, max_model_len=64)  # per request: refused before anything runs
    with pytest.raises(ValueError, match="batch_centred"):
        llm.generate([[3, 4]], SamplingParams(max_tokens=2, logprob_formula=FusedLine(batch_centred)))
    # the same line made row-invariant passes the same check
    lf.check_fused_row_invariant(FusedLine(projected_log_softmax), llm.model.lm_head.weight)


def test_what_a_fused_line_cannot_do_is_refused(tiny):
    with pytest.raises(ValueError, match="FusedLine takes fn"):
        FusedLine("trl")
    with pytest.raises(ValueError, match="use a named formula"):
        SamplingParams(logprobs_mode="processed_logprobs", logprob_formula=FusedLine(projected_log_softmax))
    logits = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="given logits only"):
        lf.token_logprobs(logits, torch.tensor([1, 2]), [1.0, 1.0], [FusedLine(projected_log_softmax)] * 2)


# --- fused cross-entropy kernels on CUDA (docs/logprobs.md "Fused cross-entropy kernels") -----------


def liger_flce(hidden, weight, ids, t):
    """Liger 0.8.5's fused linear cross-entropy (`liger_fused_linear_cross_entropy`), minus its
    per-token loss (reduction="none"), as a user's fused line. Liger takes no temperature; this
    line is Liger's at T = 1 and divides the hidden states by T in their dtype otherwise."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return -liger_fused_linear_cross_entropy(hidden if t == 1.0 else hidden / t, weight, ids, reduction="none")


def _head(n: int, width: int, vocab: int):
    """hidden [n, width] and an LM head [vocab, width] in bf16 on CUDA, ids below vocab."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, width, generator=g).bfloat16().cuda()
    weight = (torch.randn(vocab, width, generator=g) * 0.02).bfloat16().cuda()
    return hidden, weight, torch.randint(0, vocab, (n,), generator=g).cuda()


def _qwen_head(n: int):
    """hidden [n, 2048] and an LM head [151936, 2048] (Qwen3-30B-A3B's shape)."""
    return _head(n, 2048, 151_936)


def _alone_and_packed(fn, hidden, weight, ids, grad: bool = False):
    """fn on every row alone (Liger's chunk of 1 row) and on all rows at once (chunks of 8 at
    600 rows: Liger's chunk size follows the number of rows)."""
    h = hidden.detach().clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        packed = fn(h, weight, ids, 1.0).detach()
    alone = torch.cat([fn(hidden[i : i + 1], weight, ids[i : i + 1], 1.0) for i in range(len(ids))])
    return alone, packed


@pytest.mark.gpu
def test_liger_flce_as_a_fused_line_is_row_invariant_under_batch_invariant():
    # Liger chunks the rows by a size that follows their number (600 rows at V 151936, H 2048:
    # chunks of 8) and projects each chunk with `torch.mm(..., out=)` (inference) or `@` (with
    # grad); under batch_invariant() both are samebits' M-invariant GEMM, and its CE kernel is one
    # program per row, so each row's value is the same alone, packed, and in the trainer (grad).
    pytest.importorskip("liger_kernel")
    hidden, weight, ids = _qwen_head(600)
    with batch_invariant():
        lf.check_fused_row_invariant(FusedLine(liger_flce), weight)
        with torch.no_grad():
            alone, packed = _alone_and_packed(liger_flce, hidden, weight, ids)
        _, trained = _alone_and_packed(liger_flce, hidden, weight, ids, grad=True)
    assert torch.equal(alone, packed)
    assert torch.equal(packed, trained)


@pytest.mark.gpu
def test_control_liger_flce_outside_batch_invariant_changes_a_row_with_its_batch():
    # batch_invariant() is what makes Liger's chunk GEMMs row-invariant: at an LM head of
    # [4096, 4096] stock cuBLAS picks another kernel for a chunk of 1 row than for a chunk of 8, and
    # Liger's value for a row alone differs from the same row among 600 (H100, 2026-12-07: 320 of
    # 600 rows); under batch_invariant() none does. At Qwen3-30B-A3B's head ([151936, 2048]) stock
    # cuBLAS gave the same bits for a row among 1 to 9,600 rows on that card, so the packing is no
    # control there.
    pytest.importorskip("liger_kernel")
    hidden, weight, ids = _head(600, 4096, 4096)
    with torch.no_grad():
        stock_alone, stock_packed = _alone_and_packed(liger_flce, hidden, weight, ids)
        with batch_invariant():
            alone, packed = _alone_and_packed(liger_flce, hidden, weight, ids)
    assert torch.equal(alone, packed)
    assert not torch.equal(stock_alone, stock_packed)


@pytest.mark.gpu
def test_engine_with_liger_flce_as_a_fused_line_is_liger_on_the_trainers_hidden_states(tiny):
    pytest.importorskip("liger_kernel")
    llm = LLM(tiny, device="cuda", max_num_seqs=4, max_model_len=64, logprob_formula=FusedLine(liger_flce))
    params = [
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=90 + i) for i in range(4)
    ]
    outs = llm.generate([[3, 4, 5], [6, 7], [8, 9, 10, 11], [2, 12]], params)
    del llm
    model = trainer.load_hf_model(tiny, dtype=torch.bfloat16, device="cuda")
    for out in outs:
        hidden, _, tokens = hf_rows(model, out)
        with batch_invariant(), torch.no_grad():
            assert torch.equal(out.logprobs, liger_flce(hidden, model.lm_head.weight, tokens, 1.0).cpu())


@pytest.mark.gpu
def test_flash_attn_ce_is_row_invariant_where_installed():
    # verl's CUDA branch: the engine calls flash-attn's own cross_entropy_loss on its logits, so
    # it is the trainer's value where the kernel's rows do not depend on the batch
    pytest.importorskip("flash_attn.ops.triton.cross_entropy")
    from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

    hidden, weight, ids = _qwen_head(64)
    with batch_invariant(), torch.no_grad():
        logits = hidden @ weight.t()
        packed = cross_entropy_loss(logits, ids)[0]
        alone = torch.cat([cross_entropy_loss(logits[i : i + 1], ids[i : i + 1])[0] for i in range(64)])
    assert torch.equal(alone, packed)
