"""The engine core: requests joining between steps, abort, threads, n, stop strings, top log-probs, text."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.engine.detokenizer import IncrementalDetokenizer
from samebits.engine.sampler import SampleRequest, sample
from samebits.model.tiny_tokenizer import add_tiny_tokenizer, build_tiny_tokenizer
from samebits.numerics.ops import reported_logprobs
from samebits.requests.sampling_params import sample_seed
from samebits.verify import make_prompts


@pytest.fixture(scope="module")
def tok_ckpt(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tiny"
    shutil.copytree(tiny, path)
    return add_tiny_tokenizer(path)


@pytest.fixture(scope="module")
def llm(tok_ckpt):
    return LLM(tok_ckpt, max_num_seqs=4, max_model_len=128)


def _params(i, **kw):
    return SamplingParams(
        temperature=1.0, max_tokens=kw.pop("max_tokens", 12 + i), ignore_eos=True, seed=i, **kw
    )


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert torch.equal(a.logprobs, b.logprobs)


def _drive_staggered(llm, prompts, params):
    """Add request k after k steps, so each joins a batch already decoding; -> outputs by id."""
    core, ids = llm.core, []
    with core.lock:
        for k, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            ids.append(core.add_request(f"r{k}", p, sp))
            core.step()
        while core.has_unfinished():
            core.step()
        return [core.pop(r) for r in ids]


def test_requests_joining_between_steps_get_their_alone_bits(llm):
    prompts = make_prompts((9, 4, 17, 6, 11), llm.config.vocab_size, seed=3)
    params = [_params(i) for i in range(5)]
    staggered = _drive_staggered(llm, prompts, params)
    for p, sp, out in zip(prompts, params, staggered, strict=True):
        _same(llm.generate([p], sp)[0], out)
        assert out.finish_reason == "length" and len(out.token_ids) == sp.max_tokens
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_negative_control_fast_profile_depends_on_the_batch(checkpoints):
    """The same staggered check with stock kernels (fp32, numerics="fast") must fail."""
    fast = LLM(checkpoints["fp32"], dtype="float32", max_num_seqs=4, max_model_len=128, numerics="fast")
    prompts = make_prompts((9, 4, 17, 6, 11), fast.config.vocab_size, seed=3)
    params = [_params(i) for i in range(5)]
    staggered = _drive_staggered(fast, prompts, params)
    alone = [fast.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(alone, staggered, strict=True))


def test_abort_frees_blocks_at_once_and_reports_abort(llm):
    core = llm.core
    with core.lock:
        rid = core.add_request("a", [5, 6, 7, 8], _params(0, max_tokens=60))
        keep = core.add_request("b", [9, 10], _params(1, max_tokens=5))
        for _ in range(3):
            core.step()
        used = llm.block_manager.num_blocks - llm.block_manager.num_free_blocks
        assert core.abort(rid) and not core.abort("nope")
        assert llm.block_manager.num_blocks - llm.block_manager.num_free_blocks < used
        out = core.pop(rid)
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 60
        while core.has_unfinished():
            core.step()
        _same(core.pop(keep), llm.generate([[9, 10]], _params(1, max_tokens=5))[0])
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_two_threads_generate_on_one_llm_both_get_their_alone_results(llm):
    prompts = make_prompts((7, 12, 5), llm.config.vocab_size, seed=8)
    params = [_params(i, max_tokens=12) for i in range(3)]
    want = llm.generate(prompts, params)
    got: dict[int, list] = {}
    started = threading.Event()
    launch = llm.runner.launch

    def spy(*a, **k):  # the second thread starts while the first is inside a step
        started.set()
        return launch(*a, **k)

    def call(k):
        got[k] = llm.generate(prompts, params)

    llm.runner.launch = spy
    try:
        first = threading.Thread(target=call, args=(0,))
        first.start()
        assert started.wait(timeout=120)
        second = threading.Thread(target=call, args=(1,))
        second.start()
        first.join(timeout=300)
        second.join(timeout=300)
    finally:
        del llm.runner.launch
    for k in (0, 1):
        assert [o.finish_reason for o in got[k]] == ["length"] * 3
        for a, b in zip(got[k], want, strict=True):
            _same(a, b)


def _update_mid_generate(llm, update, blocks: bool):
    """generate while `update(new)` is called from another thread after the first step;
    the step waits for the update to return unless it `blocks` (on the engine lock)."""
    prompts = make_prompts((7, 12), llm.config.vocab_size, seed=8)
    params = [_params(i, max_tokens=10) for i in range(2)]
    name = "lm_head.weight"
    old = llm._params[name].clone()
    new = [(name, old * 1.5)]
    before = llm.generate(prompts, params)
    launch, fired = llm.runner.launch, []

    def spy(*a, **k):
        out = launch(*a, **k)
        out.result()  # the step is done when the update starts
        if not fired:
            fired.append(threading.Thread(target=update, args=(new,)))
            fired[0].start()
            if not blocks:
                fired[0].join(timeout=120)
        return out

    llm.runner.launch = spy
    try:
        during = llm.generate(prompts, params)
    finally:
        del llm.runner.launch
        fired[0].join(timeout=120)
    changed = not torch.equal(llm._params[name], old)
    llm.update_weights([(name, old)])
    return before, during, changed


def test_update_weights_from_another_thread_waits_for_generate(llm):
    before, during, changed = _update_mid_generate(llm, llm.update_weights, blocks=True)
    assert changed  # the update was applied, after generate
    for a, b in zip(before, during, strict=True):
        _same(a, b)


def test_negative_control_unlocked_update_mid_generate_changes_results(llm):
    """The comparison above can fail: the same update without the lock lands mid-generate."""
    unlocked = type(llm).update_weights.__wrapped__
    before, during, changed = _update_mid_generate(llm, lambda new: unlocked(llm, new), blocks=False)
    assert changed
    pairs = zip(before, during, strict=True)
    assert any(a.token_ids != b.token_ids or not torch.equal(a.logprobs, b.logprobs) for a, b in pairs)


def test_n_samples_differ_replay_the_same_and_follow_the_seed_rule(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=42, n=3)
    a, b = llm.generate([[4, 5, 6]], sp)[0], llm.generate([[4, 5, 6]], sp)[0]
    assert len(a.outputs) == 3 and len({tuple(o.token_ids) for o in a.outputs}) == 3
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs)
    for j, o in enumerate(a.outputs):
        single = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=sample_seed(42, j))
        _same(o, llm.generate([[4, 5, 6]], single)[0])
    assert a.token_ids == a.outputs[0].token_ids


def test_top_logprobs_come_from_the_sampled_tokens_row():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    reqs = [SampleRequest(SamplingParams(temperature=t, logprobs=5, seed=1), 1, 0) for t in (0.7, 1.0, 0)]
    rows = reported_logprobs(logits, torch.tensor([0.7, 1.0, 1.0]))
    for i, (token, lp, top) in enumerate(sample(logits, reqs)):
        want = torch.sort(rows[i], descending=True, stable=True)
        assert [t for t, _ in top] == want.indices[:5].tolist()
        assert torch.equal(torch.tensor([v for _, v in top]), want.values[:5])
        assert lp == rows[i, token].item()
    assert top[0][0] == token and top[0][1] == lp  # greedy row: its token is the best


def test_engine_top_logprobs_include_the_greedy_token_bitwise(llm):
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))[0]
    assert len(out.top_logprobs) == 8 and all(len(t) == 3 for t in out.top_logprobs)
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert top[0] == (token, lp.item())


def test_text_is_the_decode_of_the_tokens_and_str_prompts_work(llm, tok_ckpt):
    tok = build_tiny_tokenizer()
    outs = llm.generate(["hello world", "日本"], _params(0, max_tokens=30))
    for o in outs:
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    assert outs[0].prompt_token_ids == tok("hello world")["input_ids"]


def test_stop_strings_end_the_sample_and_are_trimmed(llm):
    base = llm.generate([[5, 6]], _params(3, max_tokens=40))[0]
    stop = base.text[10:12]
    cut = base.text.find(stop)
    out = llm.generate([[5, 6]], _params(3, max_tokens=40, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == base.text[:cut]
    assert out.token_ids == base.token_ids[: len(out.token_ids)] and len(out.token_ids) < 40
    assert torch.equal(out.logprobs, base.logprobs[: len(out.token_ids)])


def test_stop_strings_without_a_tokenizer_are_refused_before_any_work(tiny):
    plain = LLM(tiny, max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match="request 1: stop strings need detokenized text"):
        plain.generate([[1, 2], [3, 4]], [SamplingParams(), SamplingParams(stop=["x"])])
    assert not plain.core.has_unfinished() and plain.generate([[1, 2]])[0].text == ""


def test_incremental_text_buffers_partial_characters():
    tok = build_tiny_tokenizer()
    ids = tok("aé日本語🙂 ok")["input_ids"]
    detok = IncrementalDetokenizer(tok, [4, 5], stop=None)
    seen = []
    for t in ids:
        detok.add(t)
        assert "\ufffd" not in detok.text
        seen.append(detok.text)
    detok.finish()
    assert detok.text == "aé日本語🙂 ok"
    assert all(b.startswith(a) for a, b in zip(seen[:-1], seen[1:], strict=True))
    assert len(set(seen)) < len(ids)  # some tokens were partial characters, held back


def test_stop_string_across_tokens_is_held_back_then_trimmed():
    tok = build_tiny_tokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=("END",))
    for t in tok("abc ENxEND tail")["input_ids"]:
        detok.add(t)
        assert "END" not in detok.text and "abc ENxEND".startswith(detok.text)
    detok.finish()
    assert detok.stopped == "END" and detok.text == "abc ENx"
