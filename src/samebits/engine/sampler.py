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


def needs_readback(reqs: list[SampleRequest]) -> bool:
    """Whether some row asks for top log-probs: host lists built from the step's log-softmax
    rows, so its results are read back at once (`sample`), not left on the device."""
    return any(r.params.logprobs for r in reqs)


def sample_pending(logits: torch.Tensor, reqs: list[SampleRequest]) -> Pending:
    """`sample`'s rows as a `Pending`: on CUDA the rows are sampled by device ops only (banned
    tokens and top-k/top-p included: their per-row narrowing is device ops too) and the host
    does not wait for them here (a step under async scheduling, engine/core.py); rows that
    ask for top log-probs, and the CPU, get `sample`'s results at once."""
    if logits.device.type != "cuda" or needs_readback(reqs):
        return Pending.done(sample(logits, reqs), logits.device)
    temps, keys, random_row = (to_device(t, logits.device) for t in row_inputs(reqs))
    if not needs_host_rules(reqs):
        return Pending.copying(*sample_plain(logits, temps, keys, random_row))
    return Pending.copying(*_sample_with_rules(logits, reqs, temps, keys, random_row)[:2])


def sample(logits: torch.Tensor, reqs: list[SampleRequest]) -> list[tuple]:
    """logits [N, V] -> (token, float32 log-prob) per row, plus the top alternatives for rows
    that ask `logprobs=k`; one host sync for the batch (and one per such row)."""
    temps, keys, random_row = (to_device(t, logits.device) for t in row_inputs(reqs))
    if not needs_host_rules(reqs):
        tokens, chosen = sample_plain(logits, temps, keys, random_row)
        return list(zip(tokens.tolist(), chosen.tolist(), strict=True))
    tokens, chosen, lps = _sample_with_rules(logits, reqs, temps, keys, random_row)
    out = list(zip(tokens.tolist(), chosen.tolist(), strict=True))
    for i, req in enumerate(reqs):
        if req.params.logprobs:
            out[i] = (*out[i], top_logprobs(lps[i], req.params.logprobs))
    return out


def _sample_with_rules(
    logits: torch.Tensor, reqs: list[SampleRequest], temps, keys, random_row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The race over each row's narrowed distribution (banned tokens, top-k/top-p), by device
    ops -> (tokens [N], their reported log-probs [N], the log-softmax rows [N, V])."""
    lps = reported_logprobs(logits, temps)  # [N, V] float32
    probs = lps.exp()
    scores = logits.float()  # greedy rows and the underflow fallback choose by logit
    for i, req in enumerate(reqs):
        if req.banned:
            banned = to_device(torch.tensor(req.banned), logits.device)
            probs[i, banned] = 0.0
            scores[i, banned] = float("-inf")
        if req.params.temperature > 0 and (req.params.top_k != -1 or req.params.top_p < 1.0):
            probs[i] = _narrow(probs[i], req.params)
    tokens, chosen = race(lps, probs, scores, keys, random_row)
    return tokens, chosen, lps


def top_logprobs(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k largest entries of one log-softmax row [V] as (token, log-prob), best first
    (ties: the lower token id first)."""
    k = min(k, row.numel())
    order = torch.sort(row, descending=True, stable=True).indices[:k]
    return list(zip(order.tolist(), row[order].tolist(), strict=True))


class Pending:
    """A launched step's samples, maybe still being computed (async scheduling).

    `tokens` [N] int64 on the step's device, in row order: a step launched after this one
    reads its input ids from them before the host has them (stream order makes that safe;
    they are only valid until the next launch). `result()` waits for the step and returns
    (token, log-prob[, top log-probs]) per row, as `sample` does."""

    __slots__ = ("_tokens", "_results", "_host", "_event", "_device")

    def __init__(self, tokens=None, results=None, host=None, event=None, device=None):
        self._tokens, self._results, self._host, self._event, self._device = (
            tokens,
            results,
            host,
            event,
            device,
        )

    @classmethod
    def done(cls, results: list[tuple], device) -> Pending:
        """Samples the host already has (the eager path, host rules)."""
        return cls(results=results, device=device)

    @classmethod
    def copying(cls, tokens: torch.Tensor, chosen: torch.Tensor) -> Pending:
        """Samples still on the device (a CUDA graph's outputs [N]): copied into pinned host
        memory behind the step on the current stream, waited for by `result()`."""
        host = (torch.empty_like(tokens, device="cpu", pin_memory=True),
                torch.empty_like(chosen, device="cpu", pin_memory=True))  # fmt: skip
        host[0].copy_(tokens, non_blocking=True)
        host[1].copy_(chosen, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tokens.device))  # the step's device, not the current one
        return cls(tokens=tokens, host=host, event=event)

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = torch.tensor([r[0] for r in self._results], dtype=torch.long, device=self._device)
        return self._tokens

    def result(self) -> list[tuple]:
        if self._results is None:
            self._event.synchronize()
            self._results = list(zip(self._host[0].tolist(), self._host[1].tolist(), strict=True))
            self._host = self._event = None
        return self._results
