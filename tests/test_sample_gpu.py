"""CUDA: the fused decode sample (`kernels/sample_triton.py`) gives the op-by-op path's bits."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _g(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _rows(n: int, vocab: int, seed: int):
    """n rows of bf16 logits (some peaked, one with a huge spread whose tail underflows), mixed
    temperatures with greedy rows, random keys."""
    logits = (torch.randn(n, vocab, device="cuda", generator=_g(seed)) * 4).bfloat16()
    logits[1::3, seed % vocab] = 30.0  # peaked rows
    if n > 2:
        logits[2] = torch.where(logits[2] > 0, 100.0, -100.0).bfloat16()  # exp underflows to 0 and subnormals
    given = torch.tensor([0.7, 1.0, 1.3, 0.0, 0.35][:n] * (n // 5 + 1))[:n]
    random_row = (given > 0).cuda()
    temps = torch.where(given > 0, given, 1.0).float().cuda()
    keys = torch.randint(0, 2**32, (n, 2), device="cuda", generator=_g(seed + 1), dtype=torch.int64)
    return logits, temps, keys, random_row


def _composite(logits, temps, keys, random_row):
    from samebits.numerics import composite, registry

    return composite.sample_plain(logits, temps, keys, random_row, registry._multiply_by_reciprocals)


@pytest.mark.parametrize("vocab", [151936, 152064, 4097])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_fused_sample_equals_the_op_by_op_path(vocab, n):
    """Tokens and log-probs bitwise equal to the composite under batch_invariant() (the exact
    profile's tree-order log-softmax), and each log-prob is the trainer's line at its token.
    Control: the composite outside batch_invariant() (aten's stock log_softmax, another sum
    order) gives other log-prob bits on some row."""
    from samebits import batch_invariant
    from samebits.kernels.sample_launch import sample, supported

    logits, temps, keys, random_row = _rows(n, vocab, seed=vocab + n)
    assert supported(logits)
    with batch_invariant():
        want_tok, want_lp = _composite(logits, temps, keys, random_row)
        trainer_line = torch.cat(
            [
                torch.log_softmax(logits[i : i + 1].float() / float(temps[i]), dim=-1)[0, want_tok[i]][None]
                for i in range(n)
            ]
        )
    got_tok, got_lp = sample(logits, temps, keys, random_row)
    assert torch.equal(got_tok, want_tok)
    assert torch.equal(got_lp, want_lp)
    assert torch.equal(got_lp, trainer_line)
    if n > 1:  # (a single row's one log-prob may round to the same bits by chance)
        stock = _composite(logits, temps, keys, random_row)[1]
        assert not torch.equal(stock, want_lp)


def test_fused_sample_rows_do_not_depend_on_the_batch():
    """Each row alone gives the bits it gives in a batch of 64; the race follows the keys (a row
    with other keys samples other tokens)."""
    from samebits.kernels.sample_launch import sample

    logits, temps, keys, random_row = _rows(64, 151936, seed=3)
    tok, lp = sample(logits, temps, keys, random_row)
    for i in (0, 1, 2, 5, 63):
        t1, l1 = sample(logits[i : i + 1], temps[i : i + 1], keys[i : i + 1], random_row[i : i + 1])
        assert torch.equal(t1, tok[i : i + 1]) and torch.equal(l1, lp[i : i + 1]), i
    other, _ = sample(logits, temps, keys + 1, random_row)
    assert not torch.equal(other[random_row], tok[random_row])


def _spy(monkeypatch):
    """Count the registry's calls of the fused kernel."""
    from samebits.numerics import registry

    calls = []
    fused = registry._FUSED_SAMPLE
    monkeypatch.setattr(registry, "_FUSED_SAMPLE", lambda *a: calls.append(1) or fused(*a))
    return calls


def test_the_engine_samples_through_the_fused_kernel_in_the_exact_profile(monkeypatch):
    """The registry's exact CUDA entry runs the fused kernel inside batch_invariant() and the
    composite outside it (where the composite's log-softmax is aten's)."""
    from samebits import batch_invariant
    from samebits.numerics import ops, scope

    calls = _spy(monkeypatch)
    logits, temps, keys, random_row = _rows(7, 151936, seed=11)
    scope.push_profile("exact")
    try:
        with batch_invariant():
            inside = ops.sample_plain(logits, temps, keys, random_row)
        assert len(calls) == 1
        outside = ops.sample_plain(logits, temps, keys, random_row)
        assert len(calls) == 1
    finally:
        scope.pop_profile()
    from samebits.kernels.sample_launch import sample

    fused = sample(logits, temps, keys, random_row)
    assert torch.equal(inside[1], fused[1]) and torch.equal(inside[0], fused[0])
    assert torch.equal(outside[1], _composite(logits, temps, keys, random_row)[1])
    assert not torch.equal(outside[1], fused[1])


def test_vocabularies_the_fused_kernel_does_not_take_fall_back_to_the_composite(monkeypatch):
    """4096 tokens and fewer (the fold needs 64 x 128 padded slots) go op by op, same contract."""
    from samebits import batch_invariant
    from samebits.kernels.sample_launch import supported
    from samebits.numerics import ops, scope

    calls = _spy(monkeypatch)
    logits, temps, keys, random_row = _rows(7, 4096, seed=2)
    assert not supported(logits) and supported(_rows(1, 4097, seed=2)[0])
    scope.push_profile("exact")
    try:
        with batch_invariant():
            got = ops.sample_plain(logits, temps, keys, random_row)
            want = _composite(logits, temps, keys, random_row)
    finally:
        scope.pop_profile()
    assert not calls
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("vocab", [151936, 8192])
def test_rows_with_nan_or_infinite_logits_get_the_op_by_op_results(vocab):
    """A NaN logit is the largest value, as in torch.argmax/amax: the row's token is its first
    NaN and its log-prob NaN; an all-NaN or all -inf row takes token 0; a +inf logit wins
    greedy. 8192 is a power of two (no padding past the vocabulary). Control: an argmax that
    passes over NaN (what `tl.max` alone does) picks another token for the partly-NaN row."""
    from samebits import batch_invariant
    from samebits.kernels.sample_launch import sample

    logits, temps, keys, random_row = _rows(6, vocab, seed=5)
    logits[1, 77], logits[1, vocab - 5] = float("nan"), float("nan")
    logits[2] = float("nan")
    logits[3, 10] = float("inf")
    logits[4] = float("-inf")
    with batch_invariant():
        want_tok, want_lp = _composite(logits, temps, keys, random_row)
    got_tok, got_lp = sample(logits, temps, keys, random_row)
    assert torch.equal(got_tok, want_tok)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=0, equal_nan=True)  # bitwise, NaN = NaN
    assert want_tok[1] == 77 and want_tok[2] == 0 and want_tok[4] == 0
    assert torch.nan_to_num(logits[1].float(), nan=float("-inf")).argmax() != 77
