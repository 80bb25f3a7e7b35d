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


@pytest.fixture(scope="module")
def runs(tiny):
    llm = LLM(tiny, device="cpu", max_num_seqs=8, max_model_len=64, logprobs_mode="processed_logprobs")
    processed = llm.generate(PROMPTS, [_params(i, c) for i, c in enumerate(CASES)])
    modes = ("raw_logprobs", "raw_logits", "processed_logits")
    other = {m: llm.generate(PROMPTS, [_params(i, c, m) for i, c in enumerate(CASES)]) for m in modes}
    return processed, other, trainer.load_hf_model(tiny, dtype=torch.bfloat16)


def _hf(model, out):
    ids = torch.tensor(out.prompt_token_ids + out.token_ids)
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
        assert torch.equal(out.logprobs, _helper(logits, ids, case)), case
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
        assert not torch.equal(out.logprobs, _helper(logits, ids, case, top_k=case[2] + 1)), case


def test_raw_and_processed_logits_are_the_logit_and_the_scaled_logit(runs):
    processed, other, model = runs
    for case, out, raw, pro in zip(
        CASES, processed, other["raw_logits"], other["processed_logits"], strict=True
    ):
        assert raw.token_ids == pro.token_ids == out.token_ids
        logits, ids = _hf(model, out)
        at = logits.float().gather(1, ids[:, None])[:, 0]
        assert torch.equal(raw.logprobs, at), case
        assert torch.equal(pro.logprobs, (logits.float() / case[0]).gather(1, ids[:, None])[:, 0]), case
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
