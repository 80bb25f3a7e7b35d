"""`logprobs_mode` (vLLM's names): what the engine reports per token (docs/logprobs.md).

Claims: in one batch mixing temperatures 0.7/1.3, top-p < 1, top-k and formulas, each
`processed_logprobs` row equals `samebits.trainer.processed_logprobs` on the HF trainer model's
logits of the same tokens under `batch_invariant()`, bit for bit, and reports its kept count per
token; `raw_logits` / `processed_logits` are the logit / temperature-scaled logit at the token.
Controls: the raw log-probs of the same tokens differ where truncation happens; a truncation off
by one kept token (top_k + 1) differs; the sampled tokens do not depend on the mode.
"""

from __future__ import annotations

import pytest
import torch

from samebits import LLM, SamplingParams, batch_invariant, trainer

MAX_TOKENS = 6
# (temperature, top_p, top_k, formula)
CASES = [
    (0.7, 0.8, -1, None),
    (1.3, 0.8, -1, None),
    (0.7, 1.0, 5, None),
    (1.3, 0.9, 20, None),
    (1.3, 0.8, -1, "verl"),
    (0.7, 1.0, 5, "trl"),
    (1.3, 0.7, 30, "logsumexp"),
    (1.3, 1.0, -1, None),  # no truncation: processed = raw
]


def _params(i, case, mode=None):
    t, p, k, f = case
    f = None if mode and mode.endswith("_logits") else f  # logits take no log-prob formula
    return SamplingParams(
        temperature=t, top_p=p, top_k=k, logprob_formula=f, max_tokens=MAX_TOKENS, ignore_eos=True,
        seed=21 + i, logprobs=2 if i == 1 else None, logprobs_mode=mode,
    )  # fmt: skip


PROMPTS = [[3 + i % 7, 5 + i % 11, 2 + i % 5, 9][: 2 + i % 3] for i in range(len(CASES))]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def runs(tiny, request):
    # on CUDA the `trl` row runs TRL's own Triton fold on the truncated (masked) logits
    if request.param == "cuda":
        pytest.importorskip("trl")
    llm = LLM(tiny, device=request.param, max_num_seqs=8, max_model_len=64, logprobs_mode="processed_logprobs")
    processed = llm.generate(PROMPTS, [_params(i, c) for i, c in enumerate(CASES)])
    modes = ("raw_logprobs", "raw_logits", "processed_logits")
    other = {m: llm.generate(PROMPTS, [_params(i, c, m) for i, c in enumerate(CASES)]) for m in modes}
    del llm
    return processed, other, trainer.load_hf_model(tiny, dtype=torch.bfloat16, device=request.param)


def _hf(model, out):
    ids = torch.tensor(out.prompt_token_ids + out.token_ids, device=model.device)
    p = len(out.prompt_token_ids)
    with batch_invariant(), torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
    return logits[p - 1 : -1], ids[p:]


def _helper(logits, ids, case, top_k=None):
    t, p, k, f = case
    with batch_invariant():
        return trainer.processed_logprobs(
            logits, ids, t, top_p=p, top_k=k if top_k is None else top_k, formula=f or "log_softmax"
        )


def test_processed_logprobs_equal_the_trainer_helper_in_a_mixed_batch(runs):
    processed, _, model = runs
    vocab = model.config.vocab_size
    for case, out in zip(CASES, processed, strict=True):
        logits, ids = _hf(model, out)
        assert len(out.token_ids) == MAX_TOKENS
        assert torch.equal(out.logprobs, _helper(logits, ids, case).cpu()), case
        assert len(out.num_kept) == MAX_TOKENS and all(1 <= n <= vocab for n in out.num_kept)
        if case[1] == 1.0 and case[2] == -1:
            assert out.num_kept == [vocab] * MAX_TOKENS
        else:
            assert all(n < vocab for n in out.num_kept), case
        if case[2] != -1:
            assert all(n >= min(case[2], vocab) for n in out.num_kept) or case[1] < 1.0
    assert processed[1].top_logprobs is not None and len(processed[1].top_logprobs) == MAX_TOKENS


def test_control_raw_logprobs_differ_where_truncation_happens(runs):
    processed, other, _ = runs
    for case, p, r in zip(CASES, processed, other["raw_logprobs"], strict=True):
        assert p.token_ids == r.token_ids  # the mode changes what is reported, not what is sampled
        assert r.num_kept is None
        if case[1] == 1.0 and case[2] == -1:
            assert torch.equal(p.logprobs, r.logprobs), case  # nothing truncated: the same bits
        else:
            assert (p.logprobs > r.logprobs).all(), case  # renormalised over fewer tokens


def test_control_a_truncation_off_by_one_kept_token_differs(runs):
    processed, _, model = runs
    for case, out in zip(CASES, processed, strict=True):
        if case[2] == -1 or case[1] < 1.0:
            continue
        logits, ids = _hf(model, out)
        assert not torch.equal(out.logprobs, _helper(logits, ids, case, top_k=case[2] + 1).cpu()), case


def test_raw_and_processed_logits_are_the_logit_and_the_scaled_logit(runs):
    processed, other, model = runs
    for case, out, raw, pro in zip(
        CASES, processed, other["raw_logits"], other["processed_logits"], strict=True
    ):
        assert raw.token_ids == pro.token_ids == out.token_ids
        logits, ids = _hf(model, out)
        at = logits.float().gather(1, ids[:, None])[:, 0].cpu()
        assert torch.equal(raw.logprobs, at), case
        assert torch.equal(pro.logprobs, (logits.float() / case[0]).gather(1, ids[:, None])[:, 0].cpu()), case
        assert pro.num_kept is not None and raw.num_kept is None


def test_unsupported_combinations_are_refused_at_construction(tiny):
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        LLM(tiny, logprobs_mode="logits")
    with pytest.raises(ValueError, match="leave logprob_formula at 'log_softmax'"):
        LLM(tiny, logprobs_mode="raw_logits", logprob_formula="trl")
    with pytest.raises(ValueError, match="use a named formula"):
        SamplingParams(logprobs_mode="processed_logprobs", logprob_formula=lambda x, i, t: x[:, 0])
    llm = LLM(tiny, max_model_len=64, logprobs_mode="processed_logits")
    with pytest.raises(ValueError, match="logprobs_mode=.processed_logits. reports logits"):
        llm.generate([[3, 4]], SamplingParams(max_tokens=2, logprob_formula="verl"))


def _truncated_rows(device):
    """bf16 logits [6, 151936] (Qwen's width: five TRL tiles) truncated to their top 5 (-inf
    elsewhere, as processed_logprobs masks them), and ids: a kept token, and one masked."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 151_936, generator=g) * 3).bfloat16().to(device)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.float().topk(5).indices, True)
    ids = torch.stack([logits.float().argmax(1), (~keep).int().argmax(1)], 1)
    return logits.masked_fill(~keep, float("-inf")), ids


def test_trl_folds_masked_logits_as_its_finite_stand_in_does():
    # trl_cuda hands TRL's Triton fold TRL_MASKED where a row is masked; on the CPU fold (TRL's
    # order tile by tile) that stand-in gives the bits -inf gives: every masked entry adds an exact
    # 0, and a masked id reads -inf (set afterwards). Control: a stand-in close enough to the kept
    # logits (0) to add a nonzero exp changes the kept token's value.
    from samebits.numerics import logprob_formulas as lf

    masked, ids = _truncated_rows("cpu")
    temps = torch.tensor([0.7, 0.7, 1.0, 1.3, 1.3, 1e-3])
    ref = lf.trl(masked, ids, temps)
    assert torch.isfinite(ref[:, 0]).all() and torch.isneginf(ref[:, 1]).all()
    stand_in = lf.trl(masked.masked_fill(torch.isneginf(masked), lf.TRL_MASKED), ids, temps)
    assert torch.equal(stand_in[:, 0], ref[:, 0])
    near = lf.trl(masked.masked_fill(torch.isneginf(masked), 0.0), ids, temps)
    assert not torch.equal(near[:, 0], ref[:, 0])


@pytest.mark.gpu
def test_trl_on_cuda_reads_truncated_rows_through_trls_own_kernel():
    # processed_logprobs with trl on CUDA: TRL's Triton fold on a row truncated to 5 tokens of
    # 151,936 gives a finite log-prob per kept token and -inf for a masked one (the engine's and
    # the trainer's values are this one function: test_processed_logprobs_equal_the_trainer_helper
    # on CUDA). Control: TRL's kernel handed the -inf as they are gives NaN (a 1024-wide block of
    # -inf while the running max is still -inf).
    pytest.importorskip("trl")
    from samebits.numerics import logprob_formulas as lf

    masked, ids = _truncated_rows("cuda")
    temps = torch.tensor([0.7, 0.7, 1.0, 1.3, 1.3, 1e-3], device="cuda")
    got = lf.trl(masked, ids, temps)
    assert torch.isfinite(got[:, 0]).all() and torch.isneginf(got[:, 1]).all()
    assert (got[:, 0] <= 0).all()
    raw = lf._trl_fold_cuda(masked, ids[:, 0], 0.7)  # TRL's fold with no stand-in for -inf
    assert torch.isnan(raw).any()
