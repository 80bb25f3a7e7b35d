"""Sampling and the reported log-prob.

The reported log-prob is the trainer's line `torch.log_softmax(logits.float() / T, dim=-1)`
(T a Python float; `numerics.ops.reported_logprobs`, docs/design.md) of the unmodified
distribution at the sampled token (T = 1 for greedy). What is sampled may be
narrowed by top-k, top-p and min_tokens; that changes the choice only, unless the row's
`logprobs_mode` asks for the processed values (`_by_mode`, docs/logprobs.md).
Randomness is a pure function of (request seed, output index, token id),
computed on the logits' device by a counter-based hash: a request gets the same
tokens alone, in any batch, and after preemption.

A row whose params ask `logprobs=k` (k >= 1) also gets its k most likely tokens and
their log-probs: its result is (token, log-prob, [(token, log-prob), ...]) instead of
(token, log-prob). The k tokens are ranked by the engine's row (the default line, on the
truncated row in processed_logprobs, the logits in the logits modes); each one's value is
the row's own formula at that id, computed in the same call as the sampled token's, so the
sampled token's value and its top-k entry are the same bits (`_by_formula`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from samebits.model.host_copy import to_device
from samebits.numerics import truncation
from samebits.numerics.logprob_formulas import DEFAULT, Head, token_logprobs
from samebits.numerics.ops import race, reported_logprobs, sample_plain
from samebits.requests import FusedLine, SamplingParams

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


MASS_BITS, NARROW_ROWS = truncation.MASS_BITS, truncation.NARROW_ROWS  # (numerics/truncation.py)
_mass = truncation.mass  # the counts top-p sums (a seam for the tests)


def _cumsum(mass: torch.Tensor) -> torch.Tensor:
    """Inclusive scan along the vocabulary (a seam for the tests' reordered scans)."""
    return torch.cumsum(mass, dim=-1)


def keep_rows(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`truncation.keep_rows` with the sampler's scan and host copies: bool [R, V]."""
    return truncation.keep_rows(probs, top_k, top_p, lambda p, ks, ps: _narrow_pass(p, ks, ps))


def _narrow_pass(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """One pass of `keep_rows` (a seam for the tests, as `_cumsum` and `_mass` are)."""
    return truncation.keep_pass(probs, top_k, top_p, _cumsum, to_device, _mass)


def narrow_rows(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Zero the tokens outside each row's top-k, then outside its top-p nucleus (`keep_rows`):
    probs [R, V] float32 >= 0 -> narrowed probs [R, V]."""
    return torch.where(keep_rows(probs, top_k, top_p), probs, 0.0)


def has_sampling_rules(reqs: list[SampleRequest]) -> bool:
    """Whether some row bans tokens, narrows by top-k/top-p or asks for top log-probs: the
    rules path (`_device_sample`) instead of the fused plain sample."""
    return any(
        r.banned
        or r.params.logprobs
        or (r.params.temperature > 0 and _narrows(r.params))
        or _other_line(r.params)
        or _mode(r.params) != RAW
        for r in reqs
    )


RAW = "raw_logprobs"


def _mode(params: SamplingParams) -> str:
    return params.logprobs_mode or RAW


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


def has_fused_line(reqs: list[SampleRequest]) -> bool:
    """Whether some row's log-prob is a `FusedLine` of the hidden states: its step samples
    eagerly, where the runner has the hidden rows (`sample_pending`'s `head`)."""
    return any(isinstance(r.params.logprob_formula, FusedLine) for r in reqs)


def sample_pending(logits: torch.Tensor, reqs: list[SampleRequest], head: Head | None = None) -> Pending:
    """`sample`'s rows as a `Pending`: on CUDA every row is sampled by device ops (banned
    tokens, top-k/top-p and top log-probs included: the rules path is device ops too) and
    the host does not wait for them here (a step under async scheduling, engine/core.py); on
    the CPU the results at once. `head`: the rows' hidden states [N, H] and the LM head
    weight [V, H] the logits were projected by, for `FusedLine` rows."""
    tokens, chosen, tops, kept = _device_sample(logits, reqs, head)
    if logits.device.type != "cuda":
        return Pending.done(_results(tokens, chosen, tops, kept), logits.device)
    return Pending.copying(tokens, chosen, tops, **({} if kept is None else {"kept": kept}))


def sample(logits: torch.Tensor, reqs: list[SampleRequest], head: Head | None = None) -> list[tuple]:
    """logits [N, V] -> (token, float32 log-prob) per row, plus the top alternatives for rows
    that ask `logprobs=k`; one host sync for the batch."""
    return _results(*_device_sample(logits, reqs, head))


def _device_sample(logits: torch.Tensor, reqs: list[SampleRequest], head: Head | None = None) -> tuple:
    """-> tokens [N], their reported log-probs [N] and `Tops` (None when no row asks for top
    log-probs), all on the logits' device: the plain race (`sample_plain`) when no row has
    sampling rules, else the rules path over the log-softmax rows (bans, `narrow_rows`, the
    race, `Tops`)."""
    temps, keys, random_row = (to_device(t, logits.device) for t in row_inputs(reqs))
    if not has_sampling_rules(reqs):
        return (*sample_plain(logits, temps, keys, random_row), None, None)
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
    processed = [i for i, r in enumerate(reqs) if _mode(r.params).startswith("processed")]
    keep = None  # [N, V] bool: the support of each row's sampled distribution (processed rows)
    if processed:
        keep = torch.ones_like(probs, dtype=torch.bool)
        if rows:
            keep[at[0], at[1]] = False
    if narrowed:  # every narrowed row in a few batched passes (`keep_rows`)
        at = to_device(torch.tensor(narrowed), logits.device)
        picked = [reqs[i].params for i in narrowed]
        kept = keep_rows(probs.index_select(0, at), [q.top_k for q in picked], [q.top_p for q in picked])
        probs.index_copy_(0, at, torch.where(kept, probs.index_select(0, at), 0.0))
        if keep is not None:
            keep.index_copy_(0, at, kept & keep.index_select(0, at))
    tokens, chosen = race(lps, probs, scores, keys, random_row)
    chosen, values, kept_counts = _by_mode(logits, lps, keep, temps, tokens, chosen, reqs)
    asked = [(i, req.params.logprobs) for i, req in enumerate(reqs) if req.params.logprobs]
    tops = Tops.of(values, asked) if asked else None
    chosen, tops = _by_formula(logits, keep, tokens, chosen, tops, reqs, head)
    return tokens, chosen, tops, kept_counts


PROCESSED = "processed_logprobs"


def _by_formula(logits, keep, tokens, chosen, tops, reqs, head=None) -> tuple:
    """The values of the rows reported by a formula line other than the default's raw row (a
    named or user formula in raw_logprobs; every processed_logprobs row): the sampled token's
    and its top-k ids' (ranked by `_by_mode`'s rows), one `token_logprobs` call per group on
    the logits (raw) or the truncated logits (processed) -> (chosen [N], Tops or None)."""
    groups = (
        [i for i, r in enumerate(reqs) if _mode(r.params) == RAW and _other_line(r.params)],
        [i for i, r in enumerate(reqs) if _mode(r.params) == PROCESSED],
    )
    for processed, rows in enumerate(groups):
        if not rows:
            continue
        at = to_device(torch.tensor(rows), logits.device)
        src = logits.index_select(0, at)
        if processed:
            src = truncation.masked_logits(src, keep.index_select(0, at))
        ids, put = _token_and_tops(tokens.index_select(0, at), tops, rows)
        picked = [reqs[i].params for i in rows]
        lines = [q.logprob_formula or DEFAULT for q in picked]
        rows_head = None if head is None else (head[0].index_select(0, at), head[1])
        got = token_logprobs(src, ids, [q.temperature for q in picked], lines, rows_head)  # [n, 1 + w]
        chosen = chosen.index_copy(0, at, got[:, 0])
        if put is not None:
            into, frm = (to_device(t, logits.device) for t in put)
            values = tops.logprobs.index_copy(0, into, got.reshape(-1).index_select(0, frm))
            tops = tops._replace(logprobs=values)
    return chosen, tops


def _token_and_tops(tokens: torch.Tensor, tops: Tops | None, rows: list[int]) -> tuple:
    """The ids to read rows' lines at: ids [n, 1 + w] (column 0 the sampled token, then the
    row's top-k ids, the rest padded with the token), and (positions in `tops.logprobs`,
    positions in the flat [n * (1 + w)] values) of the top-k entries, or None where no row of
    `rows` has any. Index tensors are built on the host, the ids gathered on the device."""
    at, offset = {}, 0  # row -> (its first entry in tops, its k)
    for row, k in zip(*((tops.rows, tops.ks) if tops is not None else ((), ())), strict=True):
        at[row], offset = (offset, k), offset + k
    width = max((at[r][1] for r in rows if r in at), default=0)
    if width == 0:
        return tokens[:, None], None
    n = len(rows)
    index, into, frm = [], [], []
    for i, row in enumerate(rows):
        start, k = at.get(row, (0, 0))
        index += [i] + [n + start + c if c < k else i for c in range(width)]
        into += [start + c for c in range(k)]
        frm += [i * (1 + width) + 1 + c for c in range(k)]
    source = torch.cat([tokens, tops.ids])  # [n + sum k]
    ids = source.index_select(0, to_device(torch.tensor(index), tokens.device)).view(n, 1 + width)
    return ids, (torch.tensor(into), torch.tensor(frm))


def _by_mode(logits, lps, keep, temps, tokens, chosen, reqs) -> tuple:
    """The reported values by each row's `logprobs_mode` (vLLM's names; docs/logprobs.md) ->
    (the sampled tokens' values [N], the rows' full values [N, V] the top log-probs are ranked
    by, Kept or None). raw_logprobs: `chosen` and `lps` as they are; processed_logprobs: the
    default line on the truncated row (the ranking; the values are `_by_formula`'s)."""
    modes = [_mode(r.params) for r in reqs]
    if all(m == RAW for m in modes):
        return chosen, lps, None
    values = lps.clone()
    for mode in ("raw_logits", "processed_logits", "processed_logprobs"):
        rows = [i for i, m in enumerate(modes) if m == mode]
        if not rows:
            continue
        at = to_device(torch.tensor(rows), logits.device)
        rl = logits.index_select(0, at)
        if mode == "raw_logits":
            full = rl.float()
        elif mode == "processed_logits":
            full = truncation.processed_logits_rows(rl, keep.index_select(0, at), temps.index_select(0, at))
        else:  # the default line on the truncated rows ranks the top log-probs (`_by_formula`)
            rk = keep.index_select(0, at)
            full = reported_logprobs(truncation.masked_logits(rl, rk), temps.index_select(0, at))
        values.index_copy_(0, at, full)
        if mode != PROCESSED:
            token = full.gather(1, tokens.index_select(0, at)[:, None])[:, 0]
            chosen = chosen.index_copy(0, at, token)
    processed = [i for i, m in enumerate(modes) if m.startswith("processed")]
    counts = None
    if processed:
        at = to_device(torch.tensor(processed), logits.device)
        counts = Kept(processed, keep.index_select(0, at).sum(-1))
    return chosen, values, counts


class Kept(NamedTuple):
    """How many tokens the sampled distribution of each processed row kept (its support after
    bans, top-k and top-p): row i of `rows` has counts[i] (int64, on the device until read)."""

    rows: list[int]
    counts: torch.Tensor


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


def _results(
    tokens: torch.Tensor, chosen: torch.Tensor, tops: Tops | None, kept: Kept | None = None, host=()
) -> list[tuple]:
    """Host results per row: (token, log-prob[, top log-probs]) from tensors on any device;
    a processed row (`Kept`) gets (token, value, top log-probs or None, kept count). `host`:
    the host copies of the tops' ids and log-probs and of the kept counts, when made."""
    out = list(zip(tokens.tolist(), chosen.tolist(), strict=True))
    host = list(host)
    if tops is not None:
        ids, lps = (tops.ids, tops.logprobs) if not host else (host.pop(0), host.pop(0))
        for row, top in tops.lists(ids.tolist(), lps.tolist()).items():
            out[row] = (*out[row], top)
    if kept is not None:
        counts = (kept.counts if not host else host.pop(0)).tolist()
        for row, count in zip(kept.rows, counts, strict=True):
            out[row] = (*out[row][:2], out[row][2] if len(out[row]) > 2 else None, count)
    return out


class Pending:
    """A launched step's samples, maybe still being computed (async scheduling).

    `tokens` [N] int64 on the step's device, in row order: a step launched after this one
    reads its input ids from them before the host has them (stream order makes that safe;
    they are only valid until the next launch). `result()` waits for the step and returns
    (token, log-prob[, top log-probs]) per row, as `sample` does."""

    __slots__ = ("_tokens", "_results", "_host", "_event", "_device", "_tops", "_kept")

    def __init__(self, tokens=None, results=None, host=None, event=None, device=None, tops=None, kept=None):
        self._tokens, self._results, self._host, self._event, self._device = (
            tokens,
            results,
            host,
            event,
            device,
        )
        self._tops, self._kept = tops, kept

    @classmethod
    def done(cls, results: list[tuple], device) -> Pending:
        """Samples the host already has (the CPU)."""
        return cls(results=results, device=device)

    @classmethod
    def copying(
        cls, tokens: torch.Tensor, chosen: torch.Tensor, tops: Tops | None = None, kept: Kept | None = None
    ) -> Pending:
        """Samples still on the device (a CUDA graph's outputs [N], or an eager step's; with
        the asked rows' top log-probs): copied into pinned host memory behind the step on the
        current stream, waited for by `result()`."""
        parts = (tokens, chosen) if tops is None else (tokens, chosen, tops.ids, tops.logprobs)
        parts += () if kept is None else (kept.counts,)
        host = tuple(torch.empty_like(t, device="cpu", pin_memory=True) for t in parts)
        for h, t in zip(host, parts, strict=True):
            h.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tokens.device))  # the step's device, not the current one
        return cls(tokens=tokens, host=host, event=event, tops=tops, kept=kept)

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = torch.tensor([r[0] for r in self._results], dtype=torch.long, device=self._device)
        return self._tokens

    def result(self) -> list[tuple]:
        if self._results is None:
            self._event.synchronize()
            self._results = _results(*self._host[:2], self._tops, self._kept, self._host[2:])
            self._host = self._event = self._tops = self._kept = None
        return self._results
