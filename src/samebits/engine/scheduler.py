"""Who runs this step: continuous batching, chunked prefill, preemption by recompute.

Pure Python. Per-step work is bounded by the waiting + running sequences; the
scheduler keeps no reference to a finished sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from samebits.engine.block_manager import BlockManager
from samebits.engine.sequence import Sequence, SequenceStatus


class ScheduledChunk:
    """Compute tokens [start, start + num_tokens) of seq this step. `samples`: the chunk
    reaches the last known token, so the next token is sampled (set at construction, before
    the step appends that token; read several times per row per step). A plain slotted class:
    one is built per row per step, and a dataclass's `__post_init__` adds a call (~0.07 us)."""

    __slots__ = ("seq", "start", "num_tokens", "samples", "ahead")

    def __init__(self, seq: Sequence, start: int, num_tokens: int):
        self.seq = seq
        self.start = start
        self.num_tokens = num_tokens
        self.samples = start + num_tokens == len(seq.token_ids)
        self.ahead = False  # its one token is the previous step's sample, not yet known here

    def __repr__(self) -> str:
        return f"ScheduledChunk(seq={self.seq!r}, start={self.start}, num_tokens={self.num_tokens})"


@dataclass
class ScheduledBatch:
    """The chunks one engine step computes, in scheduling order. `prefix_cache_queries` /
    `prefix_cache_hits`: tokens of the sequences admitted this step with prefix sharing on,
    and of those, tokens whose K/V were found in the cache (vLLM's counters)."""

    chunks: list[ScheduledChunk]
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum([c.num_tokens for c in self.chunks])


@dataclass
class AheadPlan:
    """`Scheduler.plan_ahead`'s running chunks of the next step, before `commit_ahead`:
    `leaving` running sequences end by length at the step before; `budget` tokens are left;
    `fed` chunks are one-token decodes of the step before's samples (`ScheduledChunk.ahead`);
    the chunks in `grow` need blocks their sequences do not hold yet."""

    chunks: list[ScheduledChunk]
    leaving: int
    budget: int
    fed: int
    grow: list[ScheduledChunk]


class Scheduler:
    """Continuous batching with chunked prefill and preemption by recompute.

    Each step fits at most `max_num_batched_tokens` tokens and `max_num_seqs` running
    sequences. Running sequences go first, in admission order (decode: 1 token; prefill:
    the rest of their tokens, cut to the budget left); then waiting ones are admitted FIFO
    until one does not fit. A running sequence that cannot get a block preempts the newest
    running one (possibly itself), which goes back to the front of the queue with its blocks
    freed and is recomputed from token 0 on readmission (from after its longest cached
    prefix, its own freed blocks included, with prefix sharing on).

    With prefix sharing on (block_manager.py), an admitted sequence (readmitted ones too)
    starts after the longest cached chain of its full blocks, and every scheduled chunk
    publishes the blocks it fills. The model writes every token's K/V of a step into the
    cache before any attention of that step reads it (`model.attention.paged_attention`, per
    layer), so a sequence admitted after another in the same step already hits the blocks
    that one computes: the n samples of a request prefill their prompt once.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_manager: BlockManager,
        eos_token_ids: tuple[int, ...] = (),
    ):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.blocks = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; preemption takes from the end
        self.num_preemptions = 0  # since construction, for /metrics

    def add(self, seq: Sequence) -> None:
        """Queue seq; RuntimeError if even an empty cache could not hold it."""
        self.check_fits(seq)
        if not seq.params.ignore_eos:
            seq.stop_ids = seq.stop_ids | self.eos_token_ids
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def check_fits(self, seq: Sequence) -> None:
        """RuntimeError if even an empty cache could not hold seq."""
        # the last sampled token is never computed, so its K/V never need a slot
        most_tokens = seq.num_prompt_tokens + seq.params.max_tokens - 1
        needed = self.blocks.blocks_for(most_tokens)
        if needed > self.blocks.num_blocks:
            raise RuntimeError(
                f"a sequence of {seq.num_prompt_tokens} prompt + {seq.params.max_tokens} max_tokens "
                f"needs {needed} KV blocks but the cache has {self.blocks.num_blocks}; raise num_blocks"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_all(self) -> list[Sequence]:
        """Finish every queued and running sequence with reason "abort"; returns them."""
        aborted = [*self.running, *self.waiting]
        for seq in aborted:
            self.blocks.free(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        self.running.clear()
        self.waiting.clear()
        self.blocks.reset_prefix_cache()  # after a failed step, published blocks may hold no K/V
        return aborted

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq now (abort, or a stop string the engine found): out of the queues, its
        blocks freed at once, `finish_reason` set. A finished seq is left as it is."""
        if seq.is_finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def schedule(self) -> ScheduledBatch:
        """Pick this step's chunks and allocate their blocks."""
        batch = ScheduledBatch([])
        budget, preempted = self._schedule_running(batch.chunks, self.max_num_batched_tokens)
        if not preempted:  # readmitting what was just preempted would only thrash
            self._admit_waiting(batch, budget)
        if not batch.chunks and self.has_unfinished():
            raise RuntimeError("scheduler could not place any sequence; raise num_blocks")
        return batch

    def plan_ahead(self, prev: ScheduledBatch) -> AheadPlan | None:
        """The running sequences' chunks of the step after `prev`, planned while prev still
        runs and its samples are not known here (async scheduling, engine/core.py), as
        `schedule` would place them once prev is done: a sequence prev samples for computes
        that sample (a one-token chunk whose input id is prev's sample on the device,
        `ScheduledChunk.ahead`) and samples the one after; a chunked prefill goes on with its
        next known tokens; each cut to the budget in running order. A sequence prev's sample
        ends by length is left out (its slot counts free for `commit_ahead`'s admissions,
        its blocks not until `postprocess` frees them); one a stop token ends keeps its row,
        dropped from the step's results when the engine learns it. None where only the
        synchronous `schedule` can decide: the running sequences are not the ones prev
        computed, in order (leaving out those that ended since: a stop or an abort). Allocates
        nothing (`commit_ahead` does)."""
        # (rows of sequences that ended while prev ran are dropped from prev's results: skip them)
        finished = SequenceStatus.FINISHED  # (a local: the enum's class attribute costs ~70 ns a row)
        done = iter([c for c in prev.chunks if c.seq.status is not finished])
        chunks, grow, leaving, fed, budget, block_size = (
            [],
            [],
            0,
            0,
            self.max_num_batched_tokens,
            self.blocks.block_size,
        )
        c = next(done, None)
        for seq in self.running:
            if c is not None and c.seq is seq:  # computed in prev: it goes on from prev's end
                start, pending, end = c.start + c.num_tokens, c.samples, len(seq.token_ids)
                c = next(done, None)
                if pending:
                    if start != end:
                        return None  # (prev's sampled chunk must end at the last known token)
                    end += 1
                    if end >= seq.max_num_tokens:  # prev's sample ends it by length
                        leaving += 1
                        continue
            elif c is not None or seq.num_computed_tokens >= len(seq.token_ids):
                return None
            else:  # left out of prev by its budget: nothing pending
                start, pending, end = seq.num_computed_tokens, False, len(seq.token_ids)
            if budget == 0:
                break  # (the rest of prev's chunks were cut by the budget too: none is misplaced)
            if end - start > budget:
                end = start + budget
            chunk = ScheduledChunk(seq, start, end - start)
            if pending:  # (its input token is prev's sample, not yet in token_ids)
                chunk.samples = chunk.ahead = True
                fed += 1
            chunks.append(chunk)
            if end > len(seq.block_table) * block_size:  # (a decode row needs one every block_size tokens)
                grow.append(chunk)
            budget -= end - start
        else:
            if c is not None:
                return None
        return AheadPlan(chunks, leaving, budget, fed, grow)

    def commit_ahead(self, plan: AheadPlan) -> ScheduledBatch | None:
        """Allocate the blocks of `plan_ahead`'s chunks and admit waiting sequences into the
        budget and slots left, as `schedule` does -> the step's batch; None (nothing allocated)
        when the cache lacks a block for the running chunks (that step needs the synchronous
        `schedule`: a preemption) or the step would be empty. Publishes the blocks of chunks
        whose ids are known here (chunked prefills, admissions) as `schedule` does, and none
        that a fed row fills: its token is not known here, and the engine publishes those
        once it is (`postprocess`)."""
        bm = self.blocks
        if plan.grow and not bm.can_allocate(
            sum([bm.blocks_needed(c.seq, c.start + c.num_tokens) for c in plan.grow])
        ):
            return None
        for c in plan.grow:
            bm.allocate(c.seq, c.start + c.num_tokens)
        if len(plan.chunks) > plan.fed and bm.enable_prefix_caching:  # chunked prefills: ids known here,
            for c in plan.chunks:  # published before the admissions, as `schedule` does, so that
                if not c.ahead:  # the n samples of a request admitted now hit their prompt's blocks
                    bm.publish(c.seq, c.start + c.num_tokens)
        batch = ScheduledBatch(plan.chunks)
        self._admit_waiting(batch, plan.budget, plan.leaving)
        return batch if batch.chunks else None

    def _schedule_running(self, chunks: list[ScheduledChunk], budget: int) -> tuple[int, bool]:
        """-> (budget left, whether anything was preempted)."""
        preempted, block_size, publish = False, self.blocks.block_size, self.blocks.publish
        running = SequenceStatus.RUNNING  # (a local: the enum's class attribute costs ~70 ns a row)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not running:  # preempted for an earlier sequence
                continue
            start, end = seq.num_computed_tokens, len(seq.token_ids)
            if end - start > budget:
                end = start + budget
            if end <= len(seq.block_table) * block_size:  # its blocks hold it
                placed = True  # (most decode steps: a new block is needed every block_size tokens)
            else:
                placed, evicted = self._make_room(seq, end)
                preempted |= evicted
            if placed:
                chunks.append(ScheduledChunk(seq, start, end - start))
                if end // block_size > seq.num_hashed_blocks:  # publish's own first test, inlined
                    publish(seq, end)  # (most decode steps fill no block)
                budget -= end - start
        return budget, preempted

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, leaving: int = 0) -> None:
        """Admit FIFO; a waiting sequence holds no blocks, so it starts after its cached prefix.
        `leaving`: running sequences that end before this step runs (their slots are free)."""
        bm = self.blocks
        while self.waiting and budget > 0 and len(self.running) - leaving < self.max_num_seqs:
            seq = self.waiting[0]
            hits = bm.cached_prefix(seq)  # [] without prefix sharing
            start = len(hits) * bm.block_size
            n = min(seq.num_tokens - start, budget)
            if not bm.can_allocate(bm.admission_cost(hits, start + n)):
                break
            self.waiting.popleft()
            bm.take_prefix(seq, hits)
            bm.allocate(seq, start + n)
            bm.publish(seq, start + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.chunks.append(ScheduledChunk(seq, start, n))
            if bm.shares(seq):
                batch.prefix_cache_queries += seq.num_tokens
                batch.prefix_cache_hits += start
            budget -= n

    def _make_room(self, seq: Sequence, num_tokens: int) -> tuple[bool, bool]:
        """Allocate seq's blocks, preempting the newest running sequences.

        -> (seq got its blocks, something was preempted). seq is never placed after being
        preempted itself; a sequence alone always fits, since add() checked it against the cache.
        """
        evicted = False
        while not self.blocks.can_allocate(self.blocks.blocks_needed(seq, num_tokens)):
            victim = self._preempt_newest()
            evicted = True
            if victim is seq:
                return False, evicted
        self.blocks.allocate(seq, num_tokens)
        return True, evicted

    def _preempt_newest(self) -> Sequence:
        seq = self.running.pop()
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, tuple[int, float]]) -> list[Sequence]:
        """Advance computed tokens, append samples, finish sequences; returns those that finished.

        `sampled` maps seq_id -> (token, log-prob[, top log-probs]) for every chunk whose
        `samples` is True; the top log-probs are the caller's (engine/core.py) to keep.
        A sequence finishes by "length" at max_tokens, else by "stop" on one of its `stop_ids`
        (stop_token_ids, eos unless ignore_eos) once it has min_tokens.
        """
        finished, publish, block_size = [], self.blocks.publish, self.blocks.block_size
        sharing = self.blocks.enable_prefix_caching
        for chunk in batch.chunks:
            seq = chunk.seq
            if seq.status is SequenceStatus.FINISHED:  # aborted or stopped while its step ran
                continue  # (async scheduling): the row's result is dropped
            seq.num_computed_tokens += chunk.num_tokens
            if sharing and seq.num_computed_tokens // block_size > seq.num_hashed_blocks:
                publish(seq, seq.num_computed_tokens)  # a step scheduled ahead published nothing
            if not chunk.samples:
                continue
            out = sampled[seq.seq_id]
            token, token_ids = out[0], seq.token_ids
            token_ids.append(token)
            seq.logprobs.append(out[1])
            n = len(token_ids)
            if n >= seq.max_num_tokens:
                reason = "length"
            elif n >= seq.min_num_tokens and token in seq.stop_ids:
                reason = "stop"
            else:
                continue
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            self.blocks.free(seq)
            finished.append(seq)
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
        return finished
