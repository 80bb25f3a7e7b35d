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

from samebits import LLM, SamplingParams, batch_invariant, trainer
from samebits.numerics import logprob_formulas as lf
from samebits.requests import FusedLine

MAX_TOKENS = 5


def trl_fused_head(hidden, weight, ids, t):
    """TRL 1.16.0's fused-head line, what `add_fused_lm_head(model, temperature=t)` runs."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    return ChunkedLogProbFunction.apply(hidden, weight, None, ids, t, lf.TRL_VOCAB_TILE, None, 1.0, ())[0]


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


def _hf(model, out):
    """The trainer's final hidden states and logits at the positions that sampled, the tokens."""
    ids = torch.tensor(out.prompt_token_ids + out.token_ids, device=model.device)
    p = len(out.prompt_token_ids)
    with batch_invariant(), torch.no_grad():
        hidden = model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
        logits = model.lm_head(hidden)
    return hidden[p - 1 : -1], logits[p - 1 : -1], ids[p:]


def _fn(formula):
    return trl_fused_head if formula is None else formula.fn


def test_fused_rows_are_the_users_fn_on_the_trainers_hidden_states(fused_run):
    outs, model = fused_run
    weight = model.lm_head.weight
    for (t, formula, k), out in zip(CASES, outs, strict=True):
        if formula == "verl":
            continue
        hidden, _, tokens = _hf(model, out)
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
            _, logits, tokens = _hf(model, out)
            with batch_invariant():
                temps = torch.full(tokens.shape, t, dtype=torch.float32, device=logits.device)
                assert torch.equal(out.logprobs, lf.LINES["verl"](logits, tokens, temps).cpu())


def test_trls_fused_head_given_as_a_fused_line_is_the_named_trl_line(fused_run):
    outs, model = fused_run
    for (t, formula, _), out in zip(CASES, outs, strict=True):
        if formula is None:
            _, logits, tokens = _hf(model, out)
            with batch_invariant():
                temps = torch.full(tokens.shape, t or 1.0, dtype=torch.float32, device=logits.device)
                assert torch.equal(out.logprobs, lf.LINES["trl"](logits, tokens, temps).cpu()), t


def test_control_the_default_line_on_the_same_tokens_differs(fused_run):
    outs, model = fused_run
    got, default = [], []
    for (t, formula, _), out in zip(CASES, outs, strict=True):
        if formula is None or isinstance(formula, FusedLine):
            _, logits, tokens = _hf(model, out)
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
