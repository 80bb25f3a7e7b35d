"""What users see: decode, prefill and a whole rollout timed through `LLM.generate`.

Every number here is wall time of `LLM.generate` calls on random prompts with
`ignore_eos=True` (so every request runs its full `max_tokens`), the device synchronized
before and after. Nothing reaches into the engine: the scheduler, the host loop, chunked
prefill, CUDA graphs, sampling and detokenization-free outputs are all counted. The
functions run on any device (CPU tests use the tiny model); `samebits bench` runs them
on CUDA.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from samebits.requests import SamplingParams


@dataclass(frozen=True)
class GenerateTimes:
    """One batch point measured through `LLM.generate`.

    `prefill_s`: B prompts of `context` tokens with max_tokens=1 (their prefill, one token
    each). `first_s` / `last_s`: the same prompts with max_tokens `first` / `last`. Every
    request does `last - first` more decode steps in the second call, all of them at the
    full batch (see `first_decode_tokens`), so the difference is B-row decode steps only.
    `step_s`: the wall time of each of the `last` call's steps in which all B rows decode
    (`timed_decode_steps`), whose median is `decode_ms`.
    """

    batch: int
    context: int
    prefill_s: float
    first: int
    first_s: float
    last: int
    last_s: float
    step_s: tuple[float, ...] = ()

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens per second of the prefill-only call."""
        return self.batch * self.context / self.prefill_s

    @property
    def decode_ms(self) -> float:
        """Milliseconds per output token of every row: the median B-row decode step of the
        `last` call (the difference of two calls when no step was recorded)."""
        if self.step_s:
            return 1000 * statistics.median(self.step_s)
        return self.difference_ms

    @property
    def difference_ms(self) -> float:
        """(t_last - t_first) / (last - first): the extra time per extra token. With async
        scheduling on the H200 this came out below the graph replay of the step (a one-off
        cost in one of the two calls), hence `decode_ms` from the steps themselves."""
        return 1000 * (self.last_s - self.first_s) / (self.last - self.first)

    @property
    def decode_tok_s(self) -> float:
        """Output tokens per second of the batch at `decode_ms` a step."""
        return 1000 * self.batch / self.decode_ms


@dataclass(frozen=True)
class RolloutTimes:
    """`requests` prompts of `prompt_len` tokens, each generating `new_tokens` (ignore_eos)."""

    requests: int
    prompt_len: int
    new_tokens: int
    seconds: float

    @property
    def output_tok_s(self) -> float:
        """Generated tokens (all requests) per second of wall time, prefill included."""
        return self.requests * self.new_tokens / self.seconds


def random_prompts(
    vocab_size: int, count: int, length: int, seed: int, banned: tuple[int, ...] = ()
) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn uniformly (a fixed seed: every arm gets the same)."""
    return random_ids(vocab_size, (count, length), torch.Generator().manual_seed(seed), banned).tolist()


def random_ids(
    vocab_size: int, shape, generator: torch.Generator | None, banned: tuple[int, ...] = ()
) -> torch.Tensor:
    """Token ids of `shape` drawn uniformly from the vocabulary less `banned`: a family's
    placeholder ids (`family.never_sample`: the Omni thinker's image, video and audio tokens),
    which a text prompt cannot hold (the engine refuses a placeholder without its features).
    With none banned, the draw of `torch.randint(0, vocab_size, shape)`."""
    if not banned:
        return torch.randint(0, vocab_size, shape, generator=generator)
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[list(banned)] = False
    ids = allowed.nonzero()[:, 0]
    return ids[torch.randint(0, len(ids), shape, generator=generator)]


def first_decode_tokens(batch: int, context: int, max_num_batched_tokens: int) -> int:
    """A max_tokens past the prefill phase of `batch` prompts of `context` tokens.

    The scheduler runs decodes first and fills the rest of a step's token budget with
    prefill chunks, so the earliest prompts start decoding while later ones prefill. That
    phase lasts at most ceil(batch * context / (budget - batch)) steps; a request that
    outlives it is, in a call with more max_tokens, given the extra steps after every row
    has joined, so the extra time is full-batch decode steps.
    """
    room = max(max_num_batched_tokens - batch, 1)
    return -(-batch * context // room) + 1


def timed_generate(llm, prompts: list[list[int]], max_tokens: int, seed: int = 0) -> float:
    """Seconds of one `llm.generate` call (device synchronized before and after)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed)
    sync(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, progress=False)
    sync(llm)
    seconds = time.perf_counter() - t0
    _check_ran_to(outs, max_tokens, "timed_generate")
    return seconds


def _check_ran_to(outs, max_tokens: int, who: str) -> None:
    """ignore_eos: every request runs to max_tokens, or the timing is wrong."""
    got = {len(o.token_ids) for o in outs}
    if got != {max_tokens}:
        raise RuntimeError(f"{who}: asked for {max_tokens} tokens per request, got {sorted(got)}")


def timed_decode_steps(
    llm, prompts: list[list[int]], max_tokens: int, seed: int = 0
) -> tuple[float, list[float]]:
    """What `timed_generate` times, driven the way `LLM.generate` drives the engine core (add
    the requests, step until none is left, pop them), plus the wall time of every step in
    which all len(prompts) rows decode one token each: the interval between that step's
    return and the one before. With async scheduling a step returns once the device has
    finished the step before it, so in steady decoding an interval is the device's step
    when the host keeps up, and host + device when it does not."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed)
    core, rows, steps = llm.core, len(prompts), []
    sync(llm)
    with core.lock, llm.runner.profile.context():  # (installed once per call, as generate does)
        try:
            ids = [core.add_request(None, p, params) for p in prompts]
            t0 = before = time.perf_counter()
            while core.has_unfinished():
                out = core.step()
                now = time.perf_counter()
                if len(out.request_ids) == rows and core.stats.last_step_tokens == rows:
                    steps.append(now - before)
                before = now
        except BaseException:
            core.abort_all()
            raise
        outs = [core.pop(r) for r in ids]
    sync(llm)
    seconds = time.perf_counter() - t0
    _check_ran_to(outs, max_tokens, "timed_decode_steps")
    return seconds, steps


def warm_generate(llm, prompts: list[list[int]], max_tokens: int, seed: int = 0) -> None:
    """One untimed `llm.generate` call of the shape a timed call will have (batch, prompt
    length, max_tokens): the first call at a new shape compiles Triton kernels for the
    prefill chunks it runs (and captures CUDA graphs), which a timed call must not include."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed)
    _check_ran_to(llm.generate(prompts, params, progress=False), max_tokens, "warm_generate")
    sync(llm)


def _hits(llm) -> int:
    return llm.core.stats.prefix_cache_hits


def measure_generate(
    llm, batch: int, context: int, extra: int = 64, seed: int = 0, warm: bool = True
) -> GenerateTimes:
    """Prefill tok/s and decode ms per token of `batch` prompts of `context` tokens, all
    through `llm.generate`. Before timing, each timed shape (max_tokens 1, `first` and
    `first + extra`, at this batch and prompt length) runs once untimed (`warm_generate`):
    the first call at a new size includes Triton JIT compiles of the prefill kernels, which
    made (t_N - t_1) undercount decode (10 ms at batch 64 on an H100, below the floor).
    `warm=False` skips them (the tests' negative control only). Every call gets fresh
    prompts, and a timed call whose prompts hit the prefix cache (it skipped prefill) is
    refused. The last call (`first + extra` tokens, through the engine core as generate
    drives it) times each step in which all B rows decode: decode_ms is their median.
    `extra` is raised to `first` when that is larger, for `difference_ms`, the difference of
    two wall times, where a few percent of noise between calls with a long prefill phase (at
    batch 256 x 1k tokens, 148 steps against 32) swamped it."""
    if extra < 1:
        raise ValueError(f"extra must be an int >= 1, got {extra!r}")
    first = first_decode_tokens(batch, context, llm.engine.resolved_batched_tokens())
    extra = max(extra, first)
    shapes = (1, first, first + extra)  # max_tokens of the timed calls, in order

    def prompts(i: int) -> list[list[int]]:  # fresh prompts each call: no cache could reuse a prefill
        return random_prompts(
            llm.config.vocab_size, batch, context, seed + 1000 * batch + i, llm.family.never_sample
        )

    if warm:
        for i, n in enumerate(shapes):
            warm_generate(llm, prompts(10 + i), n, seed=seed)
    hits = _hits(llm)
    prefill_s, first_s = (timed_generate(llm, prompts(i), n, seed=seed) for i, n in ((1, 1), (2, first)))
    last_s, steps = timed_decode_steps(llm, prompts(3), first + extra, seed=seed)
    if _hits(llm) != hits:
        raise RuntimeError(
            f"measure_generate: {_hits(llm) - hits} prompt tokens of the timed calls came from the prefix "
            "cache (their prefill was skipped); build the LLM with enable_prefix_caching=False"
        )
    return GenerateTimes(batch, context, prefill_s, first, first_s, first + extra, last_s, tuple(steps))


def generate_max_len(context: int, batches, extra: int, max_num_batched_tokens: int) -> int:
    """The max_model_len `measure_generate` needs at every batch: context + its last max_tokens."""
    firsts = [first_decode_tokens(b, context, max_num_batched_tokens) for b in batches]
    return max(context + f + max(extra, f) for f in firsts)


def measure_rollout(llm, requests: int, prompt_len: int, new_tokens: int, seed: int = 0) -> RolloutTimes:
    """One rollout as an RL step issues it: `requests` prompts of `prompt_len` tokens, each
    generating `new_tokens`, in one `generate` call (kernels already warmed by the decode points)."""
    prompts = random_prompts(llm.config.vocab_size, requests, prompt_len, seed, llm.family.never_sample)
    seconds = timed_generate(llm, prompts, new_tokens, seed=seed)
    return RolloutTimes(requests, prompt_len, new_tokens, seconds)


def sync(llm) -> None:
    device = torch.device(llm.engine.device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
