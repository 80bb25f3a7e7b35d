"""Top-k / top-p narrowing of many rows at once (`sampler.narrow_rows`): what it keeps, and that
a row keeps the same tokens alone, in any batch and in any pass, because its nucleus mass is
summed in integers (exact in any order)."""

from __future__ import annotations

import pytest
import torch

from samebits.engine import sampler

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _spec(row: list[float], k: int, p: float) -> list[float]:
    """The rule in plain Python for one row: keep what is at least the k-th largest, then, in
    descending order (ties by index), each token whose strictly better mass is below p times
    the mass top-k left, the mass counted in units of 2**-MASS_BITS of the row's largest power
    of two (2**e > its largest value >= 2**(e-1)), truncated."""
    import math

    vocab = len(row)
    kth = sorted(row, reverse=True)[min(k, vocab) - 1] if k != -1 else min(row)
    left = [x if x >= kth else 0.0 for x in row]
    if p >= 1.0:
        return left
    exponent = math.frexp(max(left))[1]
    counts = [int(x * 2.0 ** (sampler.MASS_BITS - exponent)) for x in left]  # exact products
    total = sum(counts)
    keep, before = [False] * vocab, 0
    for j in sorted(range(vocab), key=lambda j: (-left[j], j)):
        keep[j] = float(before) < p * float(total)
        before += counts[j]
    return [x if kept else 0.0 for x, kept in zip(left, keep, strict=True)]


def _rows(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Softmax rows: peaked, flat, tied and with underflowed tails."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * torch.linspace(0.5, 6.0, n)[:, None]
    logits[::4, : vocab // 3] = 1.5  # a third of the row tied
    logits[1::5, 3] = 40.0  # one token holds nearly all the mass
    return torch.softmax(logits, dim=-1)


def _params(n: int) -> tuple[list[int], list[float]]:
    ks = [(-1, 1, 5, 40, 10_000)[i % 5] for i in range(n)]
    ps = [(1.0, 0.9, 0.5, 0.97, 0.3, 0.999)[i % 6] for i in range(n)]
    return ks, ps


@pytest.mark.parametrize("top_k_only", [False, True])
def test_narrow_rows_is_the_rule_written_out(top_k_only):
    """Mixed rows, and rows that all ask top-k alone (the pass's `torch.topk` path, each row
    its own k), equal the rule row by row."""
    probs = _rows(40, 300, seed=1)
    ks, ps = _params(40)
    if top_k_only:
        ks, ps = [(1, 5, 40, 299, 2)[i % 5] for i in range(40)], [1.0] * 40
    got = sampler.narrow_rows(probs, ks, ps)
    rows = zip(probs.tolist(), ks, ps, strict=True)
    want = torch.tensor([_spec(r, k, p) for r, k, p in rows], dtype=torch.float32)
    assert torch.equal(got, want)
    assert not torch.equal(got, probs)
    assert sampler.narrow_rows(probs[:0], [], []).shape == (0, 300)


def test_top_p_keeps_a_row_scaled_by_a_power_of_two_as_it_was():
    """A row's nucleus is a property of its proportions: the same rows times 2**-10, -30, -50
    (exact) keep the same tokens, as does a row whose likely token was banned (little mass left:
    it still samples among many tokens). Control: the mass counted in absolute units of 2**-40
    (not the row's own scale) keeps fewer tokens as the rows shrink, and the banned row then
    samples one token whatever its seed."""
    from samebits.engine.sampler import SampleRequest
    from samebits.requests import SamplingParams

    g = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(8, 1000, generator=g) * 2, dim=-1)
    ps = [0.3, 0.5, 0.9, 0.99] * 2
    kept = sampler.narrow_rows(probs, [-1] * 8, ps) > 0
    logits = torch.randn(1, 1000, generator=g)
    logits[0, 7] = 35.0  # eos-like: ~1 - 1e-12 of the mass, banned below
    reqs = [SampleRequest(SamplingParams(top_p=0.9, seed=s), s, 0, banned=(7,)) for s in range(40)]

    def shrinks_and_bans() -> tuple[int, int]:
        changed = sum(
            not torch.equal(sampler.narrow_rows(probs * 2.0**-k, [-1] * 8, ps) > 0, kept) for k in (10, 30, 50)
        )
        return changed, len({row[0] for row in sampler.sample(logits.expand(40, -1), reqs)})

    changed, distinct = shrinks_and_bans()
    assert changed == 0 and distinct > 20
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler, "_mass", lambda ordered: (ordered.double() * 2.0**40).to(torch.int64))
        changed, distinct = shrinks_and_bans()
    assert changed > 0 and distinct == 1


def test_top_p_stops_at_the_first_token_whose_better_mass_reaches_p():
    """Hand-made rows with exact binary masses. Control: the same row at a p just past the
    boundary keeps one token more, and top-k's ties are all kept."""
    row = torch.tensor([[0.125, 0.5, 0.125, 0.25]])
    assert sampler.narrow_rows(row, [-1], [0.75]).tolist() == [[0.0, 0.5, 0.0, 0.25]]
    assert sampler.narrow_rows(row, [-1], [0.76]).tolist() == [[0.125, 0.5, 0.0, 0.25]]  # first of the tie
    assert sampler.narrow_rows(row, [3], [1.0]).tolist() == [[0.125, 0.5, 0.125, 0.25]]  # ties at the k-th
    assert sampler.narrow_rows(row, [1], [1.0]).tolist() == [[0.0, 0.5, 0.0, 0.0]]
    # p of what top-k left (0.75): 0.6 of it is 0.45 < 0.5, so 0.25 goes (0.6 of the row would keep it)
    assert sampler.narrow_rows(row, [2], [0.6]).tolist() == [[0.0, 0.5, 0.0, 0.0]]
    assert sampler.narrow_rows(row, [2], [0.7]).tolist() == [[0.0, 0.5, 0.0, 0.25]]


def _blocked_scan(block_of_rows):
    """An inclusive scan that adds in blocks whose width depends on how many rows the call has,
    as a kernel may tile by its input's shape: another association for another batch."""

    def scan(x: torch.Tensor) -> torch.Tensor:
        width = block_of_rows(x.shape[0])
        pad = (-x.shape[1]) % width
        blocks = torch.nn.functional.pad(x, (0, pad)).view(x.shape[0], -1, width)
        inner = torch.cumsum(blocks, dim=-1)
        carried = torch.cumsum(inner[..., -1], dim=-1) - inner[..., -1]
        return (inner + carried[..., None]).view(x.shape[0], -1)[:, : x.shape[1]]

    return scan


def _adversarial_p(probs: torch.Tensor, scan) -> list[float]:
    """For each row, a p just above a float32 cumulative mass as `scan` adds it alone: where
    another association of the sum lands above that mass, the token's fate flips."""
    out = []
    for i, row in enumerate(probs):
        ordered = torch.sort(row, descending=True, stable=True).values[None]
        before = (scan(ordered) - ordered)[0]
        j = 20 + 7 * i % 200
        out.append(min(float(before[j]) / float(before[-1] + ordered[0, -1]) * (1 + 1e-12), 0.999))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_narrows_alone_as_in_any_batch(device, monkeypatch):
    """70 rows (three passes of NARROW_ROWS) with mixed top-k/top-p (some top-k alone, whose
    tails fall below the mass's unit), each narrowed alone, all in one call, in reversed order
    and in passes of other sizes, under the device's own scan and under a scan whose
    association follows the call's row count: every row the same.
    Control: the same rows, p's and scans with the mass summed in float32 (no integer counts):
    some row keeps other tokens alone than in the batch."""
    vocab = 4096
    probs = _rows(70, vocab, seed=3)
    probs[:, :2000] = probs[:, :2000].mean(dim=-1, keepdim=True) * torch.rand(70, 1) * 2  # long flat runs
    probs = (probs / probs.sum(-1, keepdim=True)).to(device)
    ks, _ = _params(70)
    scan = _blocked_scan(lambda rows: 5 + 3 * rows)
    ps = _adversarial_p(probs.cpu().float(), scan)
    for i in range(1, 70, 4):  # top-k alone (p = 1): `torch.topk` alone, the sort in the batch
        ks[i], ps[i] = max(ks[i], 2), 1.0

    def arms():
        one = [sampler.narrow_rows(probs[i : i + 1], ks[i : i + 1], ps[i : i + 1]) for i in range(70)]
        alone = torch.cat(one)
        batch = sampler.narrow_rows(probs, ks, ps)
        back = sampler.narrow_rows(probs.flip(0), ks[::-1], ps[::-1]).flip(0)
        return alone, batch, back

    def same(a, b) -> int:
        return sum(not torch.equal(x, y) for x, y in zip(a, b, strict=True))

    alone, batch, back = arms()
    assert same(alone, batch) == 0 and same(alone, back) == 0
    assert any(p < 1.0 for p in ps) and not torch.equal(batch, probs)  # the rows were narrowed
    monkeypatch.setattr(sampler, "_cumsum", scan)
    monkeypatch.setattr(sampler, "NARROW_ROWS", 29)
    reordered = arms()
    assert all(same(alone, r) == 0 for r in reordered)

    monkeypatch.setattr(sampler, "_mass", lambda ordered: ordered)  # float32 mass: order matters
    differ = same(*arms()[:2])
    print(f"float32 mass: {differ} of 70 rows differ alone vs in the batch")
    assert differ > 0


@pytest.mark.parametrize("device", DEVICES)
def test_top_logprobs_of_many_rows_are_each_rows_own_stable_order(device, monkeypatch):
    """`Tops.of` sorts the asked rows together in passes: every row's list is its own stable
    descending order (ties by the lower id), across pass edges and passes of other sizes.
    Control: the same lists with ties broken by the higher id differ (the rows have ties in
    their top entries, so the tie order is tested)."""
    vocab = 300
    lps = torch.log(_rows(75, vocab, seed=9)).to(device)
    lps[::3, 10:20] = lps[::3].max(dim=-1, keepdim=True).values  # ten tied best entries
    asked = [(i, (1, 3, 12, 20, 500)[i % 5]) for i in range(75) if i % 7 != 3]

    def want(flip: bool) -> dict[int, list[tuple[int, float]]]:
        out = {}
        for i, k in asked:
            row = lps[i].flip(0) if flip else lps[i]
            top = torch.sort(row, descending=True, stable=True)
            ids = (vocab - 1 - top.indices if flip else top.indices)[:k]
            out[i] = list(zip(ids.tolist(), top.values[:k].tolist(), strict=True))
        return out

    def lists(tops: sampler.Tops) -> dict[int, list[tuple[int, float]]]:
        return tops.lists(tops.ids.tolist(), tops.logprobs.tolist())

    got = lists(sampler.Tops.of(lps, asked))
    assert got == want(flip=False)
    monkeypatch.setattr(sampler, "NARROW_ROWS", 29)
    assert lists(sampler.Tops.of(lps, asked)) == got
    assert got != want(flip=True)


def test_requests_with_rules_sample_alone_as_in_a_batch_across_pass_edges(tiny, monkeypatch):
    """40 requests decoded together (top-k, top-p, both, min_tokens' bans, top log-probs: more
    rows with rules than one pass of NARROW_ROWS) give each request the tokens, log-probs and
    top log-probs it gets alone. Control, the batching reason: passes that narrow every row
    with its pass's first row's k and p (rows mixed up by the batch) change some request."""
    from samebits import LLM, SamplingParams
    from samebits.verify import make_prompts

    def params(i):
        return SamplingParams(
            max_tokens=6, ignore_eos=True, seed=i, top_k=(-1, 3, 40)[i % 3], top_p=(1.0, 0.6, 0.95, 0.3)[i % 4],
            min_tokens=(0, 5)[i % 2], logprobs=(None, 2)[i % 5 == 0],
        )  # fmt: skip

    llm = LLM(tiny, max_num_seqs=40, max_model_len=64)
    prompts = make_prompts([5 + i % 7 for i in range(40)], llm.config.vocab_size, seed=4)

    def outputs(reqs):
        outs = llm.generate([prompts[i] for i in reqs], [params(i) for i in reqs], progress=False)
        return [(o.token_ids, o.logprobs.tolist(), o.top_logprobs) for o in outs]

    together = outputs(range(40))
    alone = [outputs([i])[0] for i in range(40)]
    assert together == alone
    assert sampler.NARROW_ROWS < 40 and len({tuple(t) for t, _, _ in together}) > 30

    real = sampler._narrow_pass
    monkeypatch.setattr(sampler, "_narrow_pass", lambda p, ks, ps: real(p, ks[:1] * len(ks), ps[:1] * len(ps)))
    assert outputs(range(40)) != together
