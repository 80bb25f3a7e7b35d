"""`prompt_logprobs=k` (vLLM's field; engine/prompt_logprobs.py): the engine scores the prompt.

Claims: in one batch of chunked prefills (7 tokens a step) mixing temperatures, formulas, k,
n = 2 and a request that asks nothing, every prompt token after the first gets the value the
framework's own line gives it on the HF trainer model's logits at the position before, at the
request's temperature, bit for bit; its rank is 1 + the tokens the default row values higher;
the k entries are the default row's stable top k, each valued by the line; the same prompt
alone, with async scheduling, or after its blocks were cached by another request, gives the
same bits; after preemptions part way through a prompt each position is scored once.
Controls: the same values read at T = 1 (vLLM's convention for prompt log-probs) and read one
position off both differ; on stock kernels (the `fast` profile, fp32 tiny model, where stock
GEMM rows depend on M) a chunked prefill's scores differ from an unchunked one's, while the
exact profile's agree.
"""

from __future__ import annotations

import pytest
import torch
from framework_lines import theirs

from samebits import LLM, SamplingParams, batch_invariant, trainer
from samebits.verify import make_prompts

K = 3
# (temperature, formula, prompt_logprobs, n, logprobs_mode)
CASES = [
    (0.7, None, K, 1, None),
    (1.3, "verl", 0, 1, None),
    (0.0, None, K, 2, None),  # greedy: read at T = 1
    (1.3, "logsumexp", K, 1, "processed_logprobs"),  # no truncation at a prompt position
    (1.0, None, None, 1, None),  # asks nothing: scores nothing
]
LENGTHS = (13, 9, 17, 11, 15)


def _params(i, case, **over):
    t, f, k, n, mode = case
    kw = dict(temperature=t, logprob_formula=f, prompt_logprobs=k, n=n, logprobs_mode=mode, max_tokens=3)
    kw |= dict(top_p=0.8 if mode else 1.0, ignore_eos=True, seed=40 + i)
    return SamplingParams(**(kw | over))


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def run(tiny, request):
    device = request.param
    llm = LLM(tiny, device=device, max_num_seqs=6, max_model_len=64, max_num_batched_tokens=7)
    prompts = make_prompts(LENGTHS, llm.config.vocab_size, seed=3)
    params = [_params(i, c) for i, c in enumerate(CASES)]
    outs = llm.generate(prompts, params)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    del llm
    ahead = LLM(
        tiny, device=device, max_num_seqs=6, max_model_len=64, max_num_batched_tokens=7, async_scheduling=True
    )
    alone += ahead.generate(prompts, params)  # the batch again, each step launched before the last is read
    del ahead
    return prompts, params, outs, alone, trainer.load_hf_model(tiny, dtype=torch.bfloat16, device=device)


def _trainer_rows(model, prompt):
    """The HF model's final hidden states and logits at positions 0..P-2, and tokens 1..P-1."""
    ids = torch.tensor(prompt, device=model.device)
    with batch_invariant(), torch.no_grad():
        hidden = model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
        logits = model.lm_head(hidden)
    return hidden[:-1], logits[:-1], ids[1:]


def _theirs(*args):
    with batch_invariant(), torch.no_grad():  # the trainer's line, as the trainer runs it
        return theirs(*args).cpu()


def _values(out, ids):
    """The engine's values at ids [P-1, c] from out.prompt_logprobs: float32 [P-1, c]."""
    return torch.tensor(
        [[e[t].logprob for t in row] for e, row in zip(out.prompt_logprobs[1:], ids.tolist(), strict=True)]
    )


def test_every_prompt_token_is_the_frameworks_line_at_the_position_before(run):
    prompts, params, outs, _, model = run
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        hidden, logits, ids = _trainer_rows(model, prompt)
        t = sp.temperature or 1.0
        want = _theirs(sp.logprob_formula or "log_softmax", hidden, model.lm_head.weight, logits, ids, t)
        assert torch.equal(_values(out, ids[:, None])[:, 0], want), sp
        with batch_invariant():
            row = torch.log_softmax(logits.float() / t, dim=-1)  # the default line ranks
        ranks = (row > row.gather(1, ids[:, None])).sum(-1) + 1
        assert [
            e[tok].rank for e, tok in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)
        ] == ranks.tolist()
        top = torch.sort(row, dim=-1, descending=True, stable=True).indices[:, : sp.prompt_logprobs]
        for p, entry in enumerate(out.prompt_logprobs[1:]):
            listed = [tok for tok in entry if tok != prompt[p + 1] or entry[tok].rank <= sp.prompt_logprobs]
            assert sorted(listed, key=lambda tok: entry[tok].rank) == top[p].tolist()
            assert [entry[tok].rank for tok in top[p].tolist()] == list(range(1, sp.prompt_logprobs + 1))
        for j in range(top.shape[1]):
            line = sp.logprob_formula or "log_softmax"
            column = _theirs(line, hidden, model.lm_head.weight, logits, top[:, j].contiguous(), t)
            assert torch.equal(_values(out, top[:, j : j + 1])[:, 0], column)


def test_the_same_prompt_alone_or_scheduled_ahead_gives_the_same_bits(run):
    _, _, outs, alone, _ = run
    assert len(alone) == 2 * len(outs)
    for a, b in zip(outs + outs, alone, strict=True):
        assert a.prompt_logprobs == b.prompt_logprobs
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)


def test_control_temperature_and_position_are_what_the_comparison_sees(run):
    prompts, params, outs, _, model = run
    prompt, sp, out = prompts[0], params[0], outs[0]  # T = 0.7
    hidden, logits, ids = _trainer_rows(model, prompt)
    got = _values(out, ids[:, None])[:, 0]
    at_one = _theirs("log_softmax", hidden, model.lm_head.weight, logits, ids, 1.0)
    assert not torch.equal(got, at_one)  # vLLM's prompt log-probs: no temperature
    with batch_invariant():
        row = torch.log_softmax(logits.float() / sp.temperature, dim=-1).cpu()
    shifted = row[1:].gather(1, ids[:-1, None].cpu())[:, 0]  # token p+1 read at row p+1
    assert not torch.equal(got[:-1], shifted)


def test_a_cached_prefix_is_computed_again_and_scored_once_after_a_preemption(tiny):
    prompts = make_prompts((40, 33, 47), 384, seed=8)
    params = [_params(i, CASES[0], max_tokens=30) for i in range(3)]
    solo = [
        LLM(tiny, max_num_seqs=3, max_model_len=128).generate([p], [sp])[0]
        for p, sp in zip(prompts, params, strict=True)
    ]
    llm = LLM(tiny, max_num_seqs=3, max_model_len=128)
    warm = llm.generate(prompts[:1], [_params(0, CASES[4])])  # caches the prompt's blocks
    assert warm[0].prompt_logprobs is None
    hits = llm.core.stats.prefix_cache_hits
    again = llm.generate(prompts[:1], params[:1])[0]
    assert llm.core.stats.prefix_cache_hits == hits  # read nothing from the cache: scored every position
    assert again.prompt_logprobs == solo[0].prompt_logprobs
    llm.generate(prompts[:1], [_params(0, CASES[4])])  # control: a request that asks nothing hits
    assert llm.core.stats.prefix_cache_hits > hits
    # 8 blocks of 16 slots, 7 tokens a step: the three do not fit together and the scheduler
    # preempts sequences part way through their prompts, which are scored again from token 0;
    # each position must be scored once (also with the next step launched ahead)
    for async_scheduling in (False, True):
        kw = dict(block_size=16, num_blocks=8, max_num_batched_tokens=7, async_scheduling=async_scheduling)
        outs = LLM(tiny, max_num_seqs=3, max_model_len=128, **kw).generate(prompts, params)
        assert sum(o.num_preemptions for o in outs) > 0
        for o, s in zip(outs, solo, strict=True):
            assert o.prompt_logprobs == s.prompt_logprobs, async_scheduling
            assert o.token_ids == s.token_ids and torch.equal(o.logprobs, s.logprobs)


def test_control_stock_kernels_change_a_chunked_prefills_scores(checkpoints):
    """The batch claim's control, for its reason: stock GEMM rows depend on how many rows a step
    has (fp32 tiny model), so a prefill cut into 5-token chunks scores other bits there."""
    prompts = make_prompts((29, 23), 384, seed=5)
    params = [_params(i, CASES[0]) for i in range(2)]
    for numerics, same in (("exact", True), ("fast", False)):
        kw = dict(dtype="float32", max_num_seqs=2, max_model_len=64, numerics=numerics)
        whole = LLM(checkpoints["fp32"], **kw).generate(prompts, params)
        chunked = LLM(checkpoints["fp32"], max_num_batched_tokens=5, **kw).generate(prompts, params)
        equal = all(a.prompt_logprobs == b.prompt_logprobs for a, b in zip(whole, chunked, strict=True))
        assert equal == same, numerics


def test_out_of_range_is_refused_naming_the_field():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs must be None or an int in \\[0, 20\\]"):
            SamplingParams(prompt_logprobs=bad)


def test_scoring_in_pieces_of_rows_gives_the_same_bits(checkpoints, monkeypatch):
    """A long prompt is scored `ROWS` rows of logits at a time: 4-row pieces change no bit.
    Control, for its reason: on stock kernels (fp32 tiny model, where a GEMM's rows depend on
    how many it has) the same pieces change bits, so the comparison sees the LM head's rows."""
    from samebits.engine import prompt_logprobs

    prompts = make_prompts((30,), 384, seed=9)
    params = [_params(0, CASES[0])]
    for numerics, same in (("exact", True), ("fast", False)):
        kw = dict(dtype="float32", max_num_seqs=1, max_model_len=64, numerics=numerics)
        monkeypatch.setattr(prompt_logprobs, "ROWS", 64)
        whole = LLM(checkpoints["fp32"], **kw).generate(prompts, params)[0]
        monkeypatch.setattr(prompt_logprobs, "ROWS", 4)
        pieces = LLM(checkpoints["fp32"], **kw).generate(prompts, params)[0]
        assert len(whole.prompt_logprobs) == 30
        assert (pieces.prompt_logprobs == whole.prompt_logprobs) == same, numerics


def test_top_ids_are_the_stable_sorts_first_k_with_ties():
    """`top_ids` (topk of k + MARGIN candidates, reordered) gives the stable descending sort's
    first k ids, ties to the lower id, as `logprobs=k` ranks; a row with more ties at its k-th
    value than the candidates hold takes the full sort. Control: topk's own order on ties is
    not that order, so the comparison sees the tie rule."""
    from samebits.engine.prompt_logprobs import MARGIN, top_ids

    g = torch.Generator().manual_seed(2)
    rows = (torch.randn(64, 3000, generator=g) * 2).round() / 2  # few distinct values: many ties
    rows[0, :] = 0.0  # every id ties: the fallback
    rows[1, 100 : 100 + 5 * MARGIN] = 50.0  # 40 ties at the top
    for k in (1, 3, 20):
        want = torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(top_ids(rows, k), want), k
    want = torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, :20]
    assert not torch.equal(torch.topk(rows, 20, dim=-1).indices, want)
