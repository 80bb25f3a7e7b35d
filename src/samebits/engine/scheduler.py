"""Who runs this step: continuous batching, chunked prefill, preemption by recompute.

Pure Python. Per-step work is bounded by the waiting + running sequences; the
scheduler keeps no reference to a finished sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from samebits.engine.block_manager import BlockManager
from samebits.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens [start, start + num_tokens) of seq this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so the next token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class ScheduledBatch:
    chunks: list[ScheduledChunk]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_manager: BlockManager,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.blocks = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        needed = -(-(seq.num_prompt_tokens + seq.params.max_tokens) // self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            raise RuntimeError(
                f"a sequence of {seq.num_prompt_tokens} + {seq.params.max_tokens} tokens needs "
                f"{needed} KV blocks but the cache has {self.blocks.num_blocks}; raise num_blocks"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_all(self) -> list[Sequence]:
        aborted = [*self.running, *self.waiting]
        for seq in aborted:
            self.blocks.free(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        self.running.clear()
        self.waiting.clear()
        return aborted

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted while making room for an earlier one
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + n):
                continue  # seq itself was preempted
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.can_allocate(self.blocks.blocks_needed(seq, seq.num_computed_tokens + n)):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        if not chunks and self.has_unfinished():
            raise RuntimeError("scheduler could not place any sequence; raise num_blocks")
        return ScheduledBatch(chunks)

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Allocate seq's blocks, preempting the newest running sequences; False if seq itself went."""
        while not self.blocks.can_allocate(self.blocks.blocks_needed(seq, num_tokens)):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, tuple[int, float]]) -> list[Sequence]:
        """Advance computed tokens, append samples, finish sequences; returns those that finished."""
        finished = []
        for chunk in batch.chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens
            if not chunk.samples:
                continue
            token, logprob = sampled[seq.seq_id]
            seq.append_token(token, logprob)
            reason = self._finish_reason(seq, token)
            if reason:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
                self.running.remove(seq)
                self.blocks.free(seq)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.max_tokens:
            return "length"
        if seq.num_output_tokens < p.min_tokens:
            return None
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop"
        if token in self.eos_token_ids and not p.ignore_eos:
            return "stop"
        return None
