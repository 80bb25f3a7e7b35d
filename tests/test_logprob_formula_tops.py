"""Top log-probs (`logprobs=k`) by the request's `logprob_formula` and `logprobs_mode`
(engine/sampler.py `_by_formula`, docs/logprobs.md).

Claims: each top-k entry's value is the row's formula at that id, equal bit for bit to the
framework's own code called for that id (TRL's `ChunkedLogProbFunction` and
`selective_log_softmax`, verl's `logprobs_from_logits_v2` as verl writes it, PyTorch's lines), on
rows of two TRL tiles and in the engine on the tiny model's HF trainer logits; the sampled token's
value and its entry in the list are the same bits; the ranking is the engine's (the default line's
row, stable, lower id first on ties); in processed_logprobs each entry is
`trainer.processed_logprobs` at that id. Controls: the default line's values at the same ids are
not the `trl` rows' (the values before this change), and the same call with rows swapped between
formulas mismatches.
"""

from __future__ import annotations

import pytest
import torch
from framework_lines import theirs
from hf_rows import hf_rows

from samebits import LLM, SamplingParams, batch_invariant, trainer
from samebits.numerics import logprob_formulas as lf

TEMPS = (0.7, 1.0, 1.3)
K = 4
MAX_TOKENS = 5


# --- the lines at several ids per row ------------------------------------------------------------


@pytest.fixture(scope="module")
def two_tiles():
    """hidden [6, 64], an LM head past one TRL tile, its bf16 logits, and 5 ids per row (tile
    edges among random ones)."""
    vocab = lf.TRL_VOCAB_TILE + 1000
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 64, generator=g).bfloat16()
    weight = (torch.randn(vocab, 64, generator=g) * 0.5).bfloat16()
    with batch_invariant(), torch.no_grad():
        logits = hidden @ weight.t()
    ids = torch.randint(0, vocab, (6, 5), generator=g)
    ids[:, 0] = torch.tensor([0, lf.TRL_VOCAB_TILE - 1, lf.TRL_VOCAB_TILE, vocab - 1, 7, 7])
    return hidden, weight, logits, ids


@pytest.mark.parametrize("formula", lf.FORMULAS)
@pytest.mark.parametrize("t", TEMPS)
def test_each_id_of_a_row_is_the_frameworks_value_for_that_id(two_tiles, formula, t):
    hidden, weight, logits, ids = two_tiles
    with batch_invariant(), torch.no_grad():
        ours = lf.token_logprobs(logits, ids, [t] * len(ids), [formula] * len(ids))
        for j in range(ids.shape[1]):
            want = theirs(formula, hidden, weight, logits, ids[:, j], t)
            assert torch.equal(ours[:, j], want), (formula, t, j)


def test_control_rows_read_by_a_neighbours_line_mismatch(two_tiles):
    # the comparison above can fail: each formula's [n, k] values read by another formula's line
    # (its neighbour in the table) differ, cross_entropy/log_softmax excepted (the same bits)
    _, _, logits, ids = two_tiles
    neighbour = {"trl": "logsumexp", "trl_selective": "verl", "verl": "log_softmax", "logsumexp": "log_softmax"}
    with batch_invariant():
        for a, b in neighbour.items():
            n = len(ids)
            assert not torch.equal(
                lf.token_logprobs(logits, ids, [1.3] * n, [a] * n),
                lf.token_logprobs(logits, ids, [1.3] * n, [b] * n),
            ), (a, b)


# --- in the engine ---------------------------------------------------------------------------------


ENGINE_TEMPS = (*TEMPS, 0.0)  # 0: greedy, read at T = 1; its sampled token is its top-1


def _prompt(ti: int) -> list[int]:
    return [3 + ti, 5 + 2 * ti, 9, 2 + ti][: 2 + ti]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def tops_run(tiny, request):
    """One batch: every formula at every temperature, `logprobs=K`; the rows of one temperature
    share prompt and seed (so the same tokens and top ids), and the HF trainer model."""
    cases = [(f, ti) for f in lf.FORMULAS for ti in range(len(ENGINE_TEMPS))]
    params = [
        SamplingParams(
            temperature=ENGINE_TEMPS[ti], max_tokens=MAX_TOKENS, ignore_eos=True, seed=40 + ti, logprobs=K,
            logprob_formula=f,
        )
        for f, ti in cases
    ]  # fmt: skip
    device = request.param
    llm = LLM(tiny, device=device, dtype="bfloat16", max_num_seqs=len(cases), max_model_len=64)
    outs = llm.generate([_prompt(ti) for _, ti in cases], params)
    del llm
    return cases, outs, trainer.load_hf_model(tiny, dtype=torch.bfloat16, device=device)


def _top(out, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The output's top ids [n, K] (on `device`) and values [n, K] (on the CPU)."""
    ids = torch.tensor([[tok for tok, _ in step] for step in out.top_logprobs], device=device)
    values = torch.tensor([[v for _, v in step] for step in out.top_logprobs], dtype=torch.float32)
    return ids, values


def test_engine_top_logprobs_are_the_frameworks_values_at_those_ids(tops_run):
    cases, outs, model = tops_run
    weight = model.lm_head.weight
    for (formula, ti), out in zip(cases, outs, strict=True):
        t = ENGINE_TEMPS[ti] or 1.0
        hidden, logits, tokens = hf_rows(model, out)
        ids, values = _top(out, logits.device)
        assert ids.shape == (MAX_TOKENS, K)
        with batch_invariant(), torch.no_grad():
            for j in range(K):
                assert torch.equal(values[:, j], theirs(formula, hidden, weight, logits, ids[:, j], t).cpu()), (
                    formula,
                    t,
                    j,
                )
            # the ranking is the engine's: the default line's row, stable descending (lower id first)
            default = torch.log_softmax(logits.float() / t, dim=-1)
        assert torch.equal(ids, torch.sort(default, dim=-1, descending=True, stable=True).indices[:, :K])


def test_engine_sampled_value_is_its_entry_in_the_top_list(tops_run):
    cases, outs, _ = tops_run
    seen = 0
    for case, out in zip(cases, outs, strict=True):
        for tok, lp, step in zip(out.token_ids, out.logprobs.tolist(), out.top_logprobs, strict=True):
            for top_tok, top_lp in step:
                if top_tok == tok:
                    assert top_lp == lp, case  # the float32 value, both read back as Python floats
                    seen += 1
    assert seen >= len(lf.FORMULAS) * MAX_TOKENS  # every greedy step's token, at least


def test_control_the_default_lines_values_are_not_the_trl_rows(tops_run):
    # Same tokens and the same top ids (rows of one temperature share prompt and seed), other
    # values: before this change every row's list was the default line's, which mismatches
    # TRL's own values at those ids somewhere.
    cases, outs, model = tops_run
    by = {case: out for case, out in zip(cases, outs, strict=True)}
    differs = 0
    for ti in range(len(ENGINE_TEMPS)):
        trl, default = by["trl", ti], by["log_softmax", ti]
        assert trl.token_ids == default.token_ids
        (ids_a, va), (ids_b, vb) = _top(trl), _top(default)
        assert torch.equal(ids_a, ids_b)
        differs += int((va != vb).sum())
    assert differs > 0


# --- processed_logprobs --------------------------------------------------------------------------

PROCESSED = [(0.7, 0.8, -1, "trl"), (1.3, 1.0, 6, "verl"), (1.3, 0.9, -1, "logsumexp"), (0.7, 1.0, 5, None)]


def test_processed_top_logprobs_are_the_trainer_helper_at_those_ids(tiny):
    llm = LLM(tiny, device="cpu", max_num_seqs=4, max_model_len=64, logprobs_mode="processed_logprobs")
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k, logprob_formula=f, max_tokens=MAX_TOKENS,
                       ignore_eos=True, seed=60 + i, logprobs=K)
        for i, (t, p, k, f) in enumerate(PROCESSED)
    ]  # fmt: skip
    outs = llm.generate([_prompt(i % 3) for i in range(len(PROCESSED))], params)
    model = trainer.load_hf_model(tiny, dtype=torch.bfloat16)
    for (t, p, k, f), out in zip(PROCESSED, outs, strict=True):
        _, logits, tokens = hf_rows(model, out)
        ids, values = _top(out)
        line = dict(top_p=p, top_k=k, formula=f or "log_softmax")
        with batch_invariant():
            for j in range(K):
                want = trainer.processed_logprobs(logits, ids[:, j], t, **line)
                assert torch.equal(values[:, j], want), (t, p, k, f, j)
            assert torch.equal(out.logprobs, trainer.processed_logprobs(logits, tokens, t, **line))
        for tok, lp, step in zip(out.token_ids, out.logprobs.tolist(), out.top_logprobs, strict=True):
            assert dict(step).get(tok, lp) == lp
