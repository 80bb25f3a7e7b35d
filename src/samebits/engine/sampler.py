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


def _narrow(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Zero the tokens outside top-k / top-p (probs [V] float32)."""
    if params.top_k != -1 and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=0) - sorted_p  # mass of strictly better tokens
        keep_sorted = before < params.top_p * sorted_p.sum()
        keep = torch.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        probs = torch.where(keep, probs, 0.0)
    return probs


def needs_host_rules(reqs: list[SampleRequest]) -> bool:
    """Whether some row bans tokens, narrows by top-k/top-p or asks for top log-probs
    (per-row work beyond `race`)."""
    return any(
        r.banned
        or r.params.logprobs
        or (r.params.temperature > 0 and (r.params.top_k != -1 or r.params.top_p < 1.0))
        for r in reqs
    )


def row_inputs(reqs: list[SampleRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host tensors of the rows' temperatures [N] f32, keys [N, 2] i64 and random flags [N]."""
    given = np.array([r.params.temperature for r in reqs], dtype=np.float64)  # the Python floats
    random_row = given > 0
    temps = np.where(random_row, given, 1.0).astype(np.float32)  # rounded as torch.tensor rounds
    keys = row_keys([r.seed for r in reqs], [r.output_index for r in reqs])
    return torch.from_numpy(temps), keys, torch.from_numpy(random_row)


def sample_pending(logits: torch.Tensor, reqs: list[SampleRequest]) -> Pending:
    """`sample`'s rows as a `Pending`: on CUDA every row is sampled by device ops (banned
    tokens, top-k/top-p and top log-probs included: the per-row path is device ops too) and
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
    log-probs), all on the logits' device: the plain race (`sample_plain`) when no row
    narrows, else the per-row path over the log-softmax rows (bans, `_narrow`, the race)."""
    temps, keys, random_row = (to_device(t, logits.device) for t in row_inputs(reqs))
    if not needs_host_rules(reqs):
        return (*sample_plain(logits, temps, keys, random_row), None)
    lps = reported_logprobs(logits, temps)  # [N, V] float32
    probs = lps.exp()
    scores = logits.float()  # greedy rows and the underflow fallback choose by logit
    rows = [i for i, req in enumerate(reqs) for _ in req.banned]
    if rows:  # every row's bans in one write each (a family's never-sampled ids are banned in all)
        at = to_device(torch.tensor([rows, [t for req in reqs for t in req.banned]]), logits.device)
        probs[at[0], at[1]] = 0.0
        scores[at[0], at[1]] = float("-inf")
    for i, req in enumerate(reqs):
        if req.params.temperature > 0 and (req.params.top_k != -1 or req.params.top_p < 1.0):
            probs[i] = _narrow(probs[i], req.params)
    tokens, chosen = race(lps, probs, scores, keys, random_row)
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
        token id first: a stable descending sort)."""
        rows, ks = [i for i, _ in asked], [min(k, lps.shape[1]) for _, k in asked]
        order = [
            torch.sort(lps[i], descending=True, stable=True).indices[:k] for i, k in zip(rows, ks, strict=True)
        ]
        values = [lps[i][o] for i, o in zip(rows, order, strict=True)]
        return cls(rows, ks, torch.cat(order), torch.cat(values))

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
