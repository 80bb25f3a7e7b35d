"""Sampling and the reported log-prob.

The reported log-prob is the trainer's line `torch.log_softmax(logits.float() / T, dim=-1)`
(T a Python float; `numerics.ops.reported_logprobs`, docs/design.md) of the unmodified
distribution at the sampled token (T = 1 for greedy). What is sampled may be
narrowed by top-k, top-p and min_tokens; that changes the choice only.
Randomness is a pure function of (request seed, output index, token id),
computed on the logits' device by a counter-based hash: a request gets the same
tokens alone, in any batch, and after preemption.

A row whose params ask `logprobs=k` (k >= 1) also gets its k most likely tokens and
their log-probs, read from the same log-softmax row as the sampled token's log-prob:
its result is (token, log-prob, [(token, log-prob), ...]) instead of (token, log-prob).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from samebits.model.host_copy import to_device
from samebits.numerics.logprob_formulas import DEFAULT, token_logprobs
from samebits.numerics.ops import race, reported_logprobs, sample_plain
from samebits.requests import SamplingParams

_MASK64 = (1 << 63) - 1
_M32 = 0xFFFFFFFF


class SampleRequest(NamedTuple):
    """One row to sample: its settings, its seed, how many tokens it already has. (A named
    tuple: one is made per row per step, and it builds in half a frozen dataclass's time.)"""

    params: SamplingParams
    seed: int
    output_index: int
    banned: tuple[int, ...] = ()  # tokens not to sample yet (eos/stop before min_tokens)


def _row_keys(seed: int, output_index: int) -> tuple[int, int]:
    """Two 32-bit keys for one (seed, output index): the row's whole randomness."""
    mixed = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    mixed ^= mixed >> 31
    return mixed & _M32, (mixed >> 32) & _M32


def row_keys(seeds: list[int], output_indices: list[int]) -> torch.Tensor:
    """`_row_keys` of N rows at once -> keys [N, 2] int64, the same bits. numpy's uint64
    arithmetic wraps modulo 2**64 (defined, unlike torch's signed int64 overflow), and the
    mask keeps the low 63 bits, so the products need no Python big ints."""
    s = np.array(seeds, dtype=np.uint64)  # seeds < 2**63, output indices small: both fit
    i = np.array(output_indices, dtype=np.uint64)
    mixed = s * np.uint64(0x9E3779B97F4A7C15) + i * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(1)
    mixed &= np.uint64(_MASK64)
    mixed ^= mixed >> np.uint64(31)
    keys = np.stack([mixed & np.uint64(_M32), mixed >> np.uint64(32)], axis=1)  # mixed < 2**63
    return torch.from_numpy(keys.astype(np.int64)).view(-1, 2)


# Top-p sums each row's probabilities as integers: counts of 2**-MASS_BITS of the row's largest
# power of two (`_mass`). Integer sums are exact, so a row's cumulative mass, and so its nucleus,
# is the same whatever order a kernel adds in (a batched scan is another kernel than a single
# row's, and may associate differently); the scale follows the row's own largest value, so a
# row left with little mass (its likely tokens banned) is counted as finely as any other.
MASS_BITS = 32  # counts < 2**32 each: a row's sum < V * 2**32 < 2**53 (V < 2**21), exact in float64
NARROW_ROWS = 32  # rows narrowed per pass: bounds the sort's [rows, V] temporaries


def _mass(ordered: torch.Tensor) -> torch.Tensor:
    """Rows [R, V] float32 >= 0 in descending order -> int64 counts: each value times
    2**(MASS_BITS - e), where 2**e bounds the row's largest value (`frexp`), truncated. The
    scale is made from its bits and the product is exact in float64, so each count is a
    function of its row alone; a row of zeros counts 0."""
    exponent = torch.frexp(ordered[:, :1]).exponent.to(torch.int64)  # largest = m * 2**e, m in [0.5, 1)
    scale = ((MASS_BITS - exponent + 1023) << 52).view(torch.float64)  # 2**(MASS_BITS - e), exactly
    return (ordered.double() * scale).to(torch.int64)


def _cumsum(mass: torch.Tensor) -> torch.Tensor:
    """Inclusive scan along the vocabulary (a seam for the tests' reordered scans)."""
    return torch.cumsum(mass, dim=-1)


def narrow_rows(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Zero the tokens outside each row's top-k, then outside its top-p nucleus: probs [R, V]
    float32 >= 0, top_k[i] -1 (off) or >= 1, top_p[i] in (0, 1] (1: off) -> narrowed probs [R, V].

    top-k keeps the tokens at least the k-th largest probability (ties kept); top-p keeps,
    in descending order, each token whose strictly better tokens' mass is below p times the
    mass top-k left. A row's result depends on its own values only: the k-th largest value
    is one number whichever kernel selects it (`torch.topk` or the sort), the sort is a
    permutation (stable), and the mass is summed in integers (`_mass`), exact in any order.
    Rows go in passes of NARROW_ROWS, a few launches each whatever they ask."""
    if probs.shape[0] == 0:
        return probs.clone()
    out = [
        _narrow_pass(probs[lo : lo + NARROW_ROWS], top_k[lo : lo + NARROW_ROWS], top_p[lo : lo + NARROW_ROWS])
        for lo in range(0, probs.shape[0], NARROW_ROWS)
    ]
    return out[0] if len(out) == 1 else torch.cat(out)


def _narrow_pass(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = probs.shape[-1]
    ks = [vocab if k == -1 else min(k, vocab) for k in top_k]
    kth_at = to_device(torch.tensor(ks, dtype=torch.int64)[:, None] - 1, probs.device)
    if all(p >= 1.0 for p in top_p):  # top-k only: its k-th value, no full sort
        kth = torch.topk(probs, max(ks), dim=-1).values.gather(1, kth_at)
        return torch.where(probs >= kth, probs, 0.0)
    ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    kth = ordered.gather(1, kth_at)
    mass = _mass(torch.where(ordered >= kth, ordered, 0.0))  # what top-k leaves, in order
    through = _cumsum(mass)
    before = (through - mass).double()  # < 2**53 (MASS_BITS): exact
    p = to_device(torch.tensor(top_p, dtype=torch.float64)[:, None], probs.device)
    keep_ordered = (before < p * through[:, -1:].double()) | (p >= 1.0)
    keep = torch.empty_like(keep_ordered).scatter_(1, order, keep_ordered)
    return torch.where(keep & (probs >= kth), probs, 0.0)


def has_sampling_rules(reqs: list[SampleRequest]) -> bool:
    """Whether some row bans tokens, narrows by top-k/top-p or asks for top log-probs: the
    rules path (`_device_sample`) instead of the fused plain sample."""
    return any(
        r.banned
        or r.params.logprobs
        or (r.params.temperature > 0 and _narrows(r.params))
        or _other_line(r.params)
        for r in reqs
    )


def _other_line(params: SamplingParams) -> bool:
    """Whether the row's log-prob is reported by another trainer line than the default."""
    return params.logprob_formula is not None and params.logprob_formula != DEFAULT


def _narrows(params: SamplingParams) -> bool:
    return params.top_k != -1 or params.top_p < 1.0


def row_inputs(reqs: list[SampleRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host tensors of the rows' temperatures [N] f32, keys [N, 2] i64 and random flags [N]."""
    given = np.array([r.params.temperature for r in reqs], dtype=np.float64)  # the Python floats
    random_row = given > 0
    temps = np.where(random_row, given, 1.0).astype(np.float32)  # rounded as torch.tensor rounds
    keys = row_keys([r.seed for r in reqs], [r.output_index for r in reqs])
    return torch.from_numpy(temps), keys, torch.from_numpy(random_row)


def sample_pending(logits: torch.Tensor, reqs: list[SampleRequest]) -> Pending:
    """`sample`'s rows as a `Pending`: on CUDA every row is sampled by device ops (banned
    tokens, top-k/top-p and top log-probs included: the rules path is device ops too) and
    the host does not wait for them here (a step under async scheduling, engine/core.py); on
    the CPU the results at once."""
    tokens, chosen, tops = _device_sample(logits, reqs)
    if logits.device.type != "cuda":
        return Pending.done(_results(tokens, chosen, tops), logits.device)
    return Pending.copying(tokens, chosen, tops)


def sample(logits: torch.Tensor, reqs: list[SampleRequest]) -> list[tuple]:
    """logits [N, V] -> (token, float32 log-prob) per row, plus the top alternatives for rows
    that ask `logprobs=k`; one host sync for the batch."""
    return _results(*_device_sample(logits, reqs))


def _device_sample(logits: torch.Tensor, reqs: list[SampleRequest]) -> tuple:
    """-> tokens [N], their reported log-probs [N] and `Tops` (None when no row asks for top
    log-probs), all on the logits' device: the plain race (`sample_plain`) when no row has
    sampling rules, else the rules path over the log-softmax rows (bans, `narrow_rows`, the
    race, `Tops`)."""
    temps, keys, random_row = (to_device(t, logits.device) for t in row_inputs(reqs))
    if not has_sampling_rules(reqs):
        return (*sample_plain(logits, temps, keys, random_row), None)
    lps = reported_logprobs(logits, temps)  # [N, V] float32
    probs = lps.exp()
    rows = [i for i, req in enumerate(reqs) for _ in req.banned]
    # greedy rows and the underflow fallback choose by logit; a copy where bans write into it
    scores = logits.to(torch.float32, copy=bool(rows))
    if rows:  # every row's bans in one write each (a family's never-sampled ids are banned in all)
        at = to_device(torch.tensor([rows, [t for req in reqs for t in req.banned]]), logits.device)
        probs[at[0], at[1]] = 0.0
        scores[at[0], at[1]] = float("-inf")
    narrowed = [i for i, r in enumerate(reqs) if r.params.temperature > 0 and _narrows(r.params)]
    if narrowed:  # every narrowed row in a few batched passes (`narrow_rows`)
        at = to_device(torch.tensor(narrowed), logits.device)
        picked = [reqs[i].params for i in narrowed]
        kept = narrow_rows(probs.index_select(0, at), [q.top_k for q in picked], [q.top_p for q in picked])
        probs.index_copy_(0, at, kept)
    tokens, chosen = race(lps, probs, scores, keys, random_row)
    lined = [i for i, r in enumerate(reqs) if _other_line(r.params)]
    if lined:  # the sampled tokens' log-probs by each row's own trainer line
        at = to_device(torch.tensor(lined), logits.device)
        picked = [reqs[i].params for i in lined]
        chosen = chosen.index_copy(
            0,
            at,
            token_logprobs(
                logits.index_select(0, at),
                tokens.index_select(0, at),
                [q.temperature for q in picked],
                [q.logprob_formula for q in picked],
            ),
        )
    asked = [(i, req.params.logprobs) for i, req in enumerate(reqs) if req.params.logprobs]
    return tokens, chosen, Tops.of(lps, asked) if asked else None


class Tops(NamedTuple):
    """The top log-probs of the rows that ask for them, on the device until read: row i of
    `rows` takes ks[i] entries, in order, of the concatenated ids and log-probs."""

    rows: list[int]
    ks: list[int]
    ids: torch.Tensor  # [sum k] int64
    logprobs: torch.Tensor  # [sum k] float32

    @classmethod
    def of(cls, lps: torch.Tensor, asked: list[tuple[int, int]]) -> Tops:
        """The k largest entries of each asked row of lps [N, V], best first (ties: the lower
        token id first: a stable descending sort, a permutation fixed by the row alone), the
        asked rows sorted together in passes of NARROW_ROWS."""
        rows, ks = [i for i, _ in asked], [min(k, lps.shape[1]) for _, k in asked]
        ids, values = [], []
        for lo in range(0, len(rows), NARROW_ROWS):
            part, width = ks[lo : lo + NARROW_ROWS], max(ks[lo : lo + NARROW_ROWS])
            at = to_device(torch.tensor(rows[lo : lo + NARROW_ROWS]), lps.device)
            picked = lps.index_select(0, at)
            order = torch.sort(picked, dim=-1, descending=True, stable=True).indices[:, :width]
            flat = torch.tensor([r * width + c for r, k in enumerate(part) for c in range(k)])
            flat = to_device(flat, lps.device)  # row r's first k of its `width` columns
            ids.append(order.reshape(-1).index_select(0, flat))
            values.append(picked.gather(1, order).reshape(-1).index_select(0, flat))
        return cls(rows, ks, *(t[0] if len(t) == 1 else torch.cat(t) for t in (ids, values)))

    def lists(self, ids: list[int], logprobs: list[float]) -> dict[int, list[tuple[int, float]]]:
        """row -> [(token, log-prob), ...] from the host copies of `ids` and `logprobs`."""
        out, at = {}, 0
        for row, k in zip(self.rows, self.ks, strict=True):
            out[row] = list(zip(ids[at : at + k], logprobs[at : at + k], strict=True))
            at += k
        return out


def _results(tokens: torch.Tensor, chosen: torch.Tensor, tops: Tops | None, ids=None, lps=None) -> list[tuple]:
    """Host results per row: (token, log-prob[, top log-probs]) from tensors on any device
    (`ids`, `lps`: host copies of the tops' tensors, when made)."""
    out = list(zip(tokens.tolist(), chosen.tolist(), strict=True))
    if tops is not None:
        ids, lps = (tops.ids, tops.logprobs) if ids is None else (ids, lps)
        for row, top in tops.lists(ids.tolist(), lps.tolist()).items():
            out[row] = (*out[row], top)
    return out


class Pending:
    """A launched step's samples, maybe still being computed (async scheduling).

    `tokens` [N] int64 on the step's device, in row order: a step launched after this one
    reads its input ids from them before the host has them (stream order makes that safe;
    they are only valid until the next launch). `result()` waits for the step and returns
    (token, log-prob[, top log-probs]) per row, as `sample` does."""

    __slots__ = ("_tokens", "_results", "_host", "_event", "_device", "_tops")

    def __init__(self, tokens=None, results=None, host=None, event=None, device=None, tops=None):
        self._tokens, self._results, self._host, self._event, self._device = (
            tokens,
            results,
            host,
            event,
            device,
        )
        self._tops = tops

    @classmethod
    def done(cls, results: list[tuple], device) -> Pending:
        """Samples the host already has (the CPU)."""
        return cls(results=results, device=device)

    @classmethod
    def copying(cls, tokens: torch.Tensor, chosen: torch.Tensor, tops: Tops | None = None) -> Pending:
        """Samples still on the device (a CUDA graph's outputs [N], or an eager step's; with
        the asked rows' top log-probs): copied into pinned host memory behind the step on the
        current stream, waited for by `result()`."""
        parts = (tokens, chosen) if tops is None else (tokens, chosen, tops.ids, tops.logprobs)
        host = tuple(torch.empty_like(t, device="cpu", pin_memory=True) for t in parts)
        for h, t in zip(host, parts, strict=True):
            h.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tokens.device))  # the step's device, not the current one
        return cls(tokens=tokens, host=host, event=event, tops=tops)

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = torch.tensor([r[0] for r in self._results], dtype=torch.long, device=self._device)
        return self._tokens

    def result(self) -> list[tuple]:
        if self._results is None:
            self._event.synchronize()
            self._results = _results(*self._host[:2], self._tops, *self._host[2:])
            self._host = self._event = self._tops = None
        return self._results
