"""Decode steps captured in CUDA graphs, one per padded batch size.

A decode step (every sequence feeds exactly one token) of B sequences replays
the graph of the smallest captured size >= B. The padding rows feed token 0 at
position 0, write their K/V into a dummy cache block that no sequence owns and
attend over that one key. Every kernel in the forward is batch invariant, so a
real row's bits are the same in the padded graph as in an eager step of B rows
(tested). Graphs are captured lazily, on the first step that needs a size, from
static input buffers; `reset()` drops them (the KV cache moved).
"""

from __future__ import annotations

import torch

from samebits.engine.scheduler import ScheduledBatch
from samebits.model.attention import PagedAttentionMetadata


def graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 16 ... up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return (*sizes, max_num_seqs)


class DecodeGraphs:
    def __init__(self, runner, sizes: tuple[int, ...], max_pages: int, dummy_block: int):
        self.runner = runner
        self.sizes = sizes
        self.dummy_block = dummy_block
        dev, n = runner.device, max(sizes)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_pages, dtype=torch.int32, device=dev)
        self.q_start = torch.arange(n, dtype=torch.int32, device=dev)
        self.q_len = torch.ones(n, dtype=torch.int32, device=dev)
        self.ctx_len = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def reset(self) -> None:
        self.graphs.clear()
        self.pool = None

    def size_for(self, batch: ScheduledBatch) -> int | None:
        """The padded size that can run this batch as a graph, or None (run it eagerly)."""
        if not all(c.num_tokens == 1 and c.samples for c in batch.chunks):
            return None
        if any(len(c.seq.block_table) > self.block_tables.shape[1] for c in batch.chunks):
            return None
        return next((s for s in self.sizes if s >= len(batch.chunks)), None)

    def run(self, batch: ScheduledBatch, size: int) -> torch.Tensor:
        """Logits [B, V] of the batch's B sequences, from the graph of `size` rows."""
        self._fill(batch, size)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[: len(batch.chunks)]

    def _meta(self, size: int) -> PagedAttentionMetadata:
        return PagedAttentionMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            q_start=self.q_start[:size],
            q_len=self.q_len[:size],
            ctx_len=self.ctx_len[:size],
            max_q_len=1,
            block_size=self.runner.block_size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        model = self.runner.model
        hidden = model(self.input_ids[:size], self._meta(size), self.runner.kv_caches)
        return model.compute_logits(hidden)

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._forward(size)  # compile every kernel for this size outside the capture
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(size)
        return graph, logits

    def _fill(self, batch: ScheduledBatch, size: int) -> None:
        bs = self.runner.block_size
        ids, pos, slots, ctx = [0] * size, [0] * size, [self.dummy_block * bs] * size, [1] * size
        tables = torch.full((size, self.block_tables.shape[1]), self.dummy_block, dtype=torch.int32)
        for i, c in enumerate(batch.chunks):
            p = c.start
            table = c.seq.block_table
            ids[i], pos[i], ctx[i] = c.seq.token_ids[p], p, p + 1
            slots[i] = table[p // bs] * bs + p % bs
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        self.input_ids[:size].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(pos), non_blocking=True)
        self.slot_mapping[:size].copy_(torch.tensor(slots), non_blocking=True)
        self.ctx_len[:size].copy_(torch.tensor(ctx, dtype=torch.int32), non_blocking=True)
        self.block_tables[:size].copy_(tables, non_blocking=True)
