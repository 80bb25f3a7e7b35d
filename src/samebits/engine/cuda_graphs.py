"""Decode steps captured in CUDA graphs, one per padded batch size.

A decode step (every sequence feeds exactly one token and the model family has no
extra inputs for it) of B sequences replays the graph of the smallest captured
size >= B. Its inputs are static buffers: token ids, cache slots, block tables,
and the family's rotary positions ([N], or [3, N] T/H/W rows for M-RoPE), filled
from `family.positions` before every replay. The padding rows feed token 0 at
position 0, write their K/V into a dummy cache block that no sequence owns and
attend over that one key. Every kernel in the forward is batch invariant, so a
real row's bits are the same in the padded graph as in an eager step of B rows
(tested). Graphs are captured lazily, on the first step that needs a size, from
static input buffers; `reset()` drops them (the KV cache moved). A size has up to two
graphs: one that ends in the fused plain sample, and one that ends at the logits, for
steps whose rows have sampling rules (banned tokens, top-k/top-p, top log-probs: every
step of a family that never samples some ids), which the sampler's rules path samples
after the replay; each is captured the first time a step needs it.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from samebits.engine.sampler import (
    Pending,
    SampleRequest,
    has_sampling_rules,
    row_inputs,
    sample_pending,
    sample_plain,
)
from samebits.engine.scheduler import ScheduledBatch
from samebits.model.attention import AttentionBatch
from samebits.model.host_copy import copy_to_device


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
        self.max_pages = max_pages
        dev, n = runner.device, max(sizes)
        # rows: input ids, positions, cache slots, the two noise keys, random (1) or greedy (0),
        # and with async scheduling each row's index into the previous step's samples
        self.i64 = torch.zeros(7, n, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_pages, dtype=torch.int32, device=dev)
        self.ctx_len = torch.ones(n, dtype=torch.int32, device=dev)
        self.q_start = torch.arange(n + 1, dtype=torch.int32, device=dev)  # query_start_loc
        self.q_len = torch.ones(n, dtype=torch.int32, device=dev)
        self.temps = torch.ones(n, dtype=torch.float32, device=dev)
        self.positions = None  # [N] or [3, N], the family's shape and dtype, made at the first fill
        # (size, sampled) -> (graph, its outputs: (logits, tokens, chosen) or (logits,))
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool = None
        self.table_rows = TableRows(max_pages, dummy_block)

    def reset(self) -> None:
        self.graphs.clear()
        self.pool = None

    def size_for(self, batch: ScheduledBatch) -> int | None:
        """The padded size that can run this batch as a graph, or None (run it eagerly)."""
        pages = self.max_pages  # a decode step whose tables fit the static buffer
        if not all(c.num_tokens == 1 and c.samples and len(c.seq.block_table) <= pages for c in batch.chunks):
            return None
        return next((s for s in self.sizes if s >= len(batch.chunks)), None)

    def run(
        self, batch: ScheduledBatch, size: int, reqs: list[SampleRequest], positions: torch.Tensor, ahead=None
    ) -> Pending:
        """(token, log-prob) of the batch's B sequences, from the graph of `size` rows;
        `positions` [B] or [3, B]: the family's rotary positions of the B tokens; `ahead`:
        `ModelRunner.launch`'s. Every input is copied from pinned host memory without a
        stream sync, so the host never waits for the step before (async scheduling)."""
        self._fill(batch, size, reqs, ahead)
        self._fill_positions(positions, size)
        n = len(batch.chunks)
        if ahead is not None:  # the input ids: the previous step's samples, still on the device
            self.i64[0, :n] = ahead[1][self.i64[6, :n]]
        sampled = not has_sampling_rules(reqs)  # else banned tokens, top-k/top-p, top log-probs
        if (size, sampled) not in self.graphs:
            self.graphs[size, sampled] = self._capture(size, sampled)
        graph, outputs = self.graphs[size, sampled]
        graph.replay()
        if not sampled:  # the rules path on the logits, queued before the next replay
            return sample_pending(outputs[0][:n], reqs)
        return Pending.copying(outputs[1][:n], outputs[2][:n])

    def _meta(self, size: int) -> AttentionBatch:
        return AttentionBatch(
            positions=self.i64[1, :size],
            slot_mapping=self.i64[2, :size],
            block_table=self.block_tables[:size],
            query_start_loc=self.q_start[: size + 1],
            query_lens=self.q_len[:size],
            seq_lens=self.ctx_len[:size],
            max_query_len=1,
            block_size=self.runner.block_size,
        )

    def _forward(self, size: int, sampled: bool) -> tuple[torch.Tensor, ...]:
        model = self.runner.model
        positions = self.positions[..., :size]
        hidden = model(self.i64[0, :size], positions, self._meta(size), self.runner.kv_caches)
        logits = model.compute_logits(hidden)
        if not sampled:
            return (logits,)
        keys = self.i64[3:5, :size].t()
        tokens, chosen = sample_plain(logits, self.temps[:size], keys, self.i64[5, :size] != 0)
        return logits, tokens, chosen

    def _capture(self, size: int, sampled: bool) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        self._forward(size, sampled)  # compile every kernel for this size outside the capture
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            outs = self._forward(size, sampled)
        return graph, outs

    def _fill(self, batch: ScheduledBatch, size: int, reqs: list[SampleRequest], ahead=None) -> None:
        """Write the B = len(batch.chunks) rows' inputs into the static buffers of `size` rows:
        per row a few list reads, the rest whole-batch numpy ops (a numpy op costs ~1 us on
        the host, a torch op ~5 us), one copy per buffer. With `ahead` the input ids are not
        on the host: row 6 of `i64` gets each row's index into the previous step's samples."""
        bs, chunks, n = self.runner.block_size, batch.chunks, len(batch.chunks)
        kept, padding = self.table_rows, self.table_rows.padding.numpy()
        tables = np.concatenate([kept.row(c.seq) for c in chunks] + [padding] * (size - n))
        tables = tables.reshape(size, -1)  # [size, P] int32
        pos = np.array([c.start for c in chunks], dtype=np.int64)  # [B]
        temps, keys, random_row = row_inputs(reqs)
        rows = np.zeros((7, size), dtype=np.int64)
        if ahead is None:
            rows[0, :n] = [c.seq.token_ids[c.start] for c in chunks]
        else:
            rows[6, :n] = ahead[0]
        rows[1, :n] = pos
        rows[2] = self.dummy_block * bs
        rows[2, :n] = tables[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs  # cache slots
        rows[3:5, :n] = keys.numpy().T
        rows[5, :n] = random_row.numpy()
        ctx = np.ones(size, dtype=np.int32)
        ctx[:n] = pos + 1
        copy_to_device(self.i64[:, :size], torch.from_numpy(rows))
        copy_to_device(self.block_tables[:size], torch.from_numpy(tables))
        copy_to_device(self.ctx_len[:size], torch.from_numpy(ctx))
        copy_to_device(self.temps[:size], torch.cat([temps, torch.ones(size - n)]))

    def _fill_positions(self, positions: torch.Tensor, size: int) -> None:
        """Copy the B rows' positions into the static buffer; padding rows get position 0."""
        if self.positions is None:
            n = max(self.sizes)
            self.positions = torch.zeros(
                *positions.shape[:-1], n, dtype=positions.dtype, device=self.runner.device
            )
        padded = torch.zeros(*positions.shape[:-1], size, dtype=positions.dtype)
        padded[..., : positions.shape[-1]] = positions
        copy_to_device(self.positions[..., :size], padded)


class TableRows:
    """Each sequence's block table as a host int32 row of `pages` entries, padded with the
    dummy block, kept from step to step: a decoding sequence gains one block every
    block_size tokens, so its row is extended, not rebuilt (rebuilding 256 rows of 128
    pages from Python lists took 2.6 ms a step). The block manager only ever appends to a
    sequence's `block_table` list in place, and gives it a new list when it frees its blocks
    (a preemption) or hands it cached ones, so a row whose list is no longer the one it was
    built from is rebuilt. Rows live as long as their sequence."""

    def __init__(self, pages: int, dummy: int):
        self.pages, self.dummy = pages, dummy
        self.padding = torch.full((pages,), dummy, dtype=torch.int32)  # a padding row's table
        # seq_id -> [the block_table list the row was built from, its entries written, the row];
        # a plain dict (a WeakKeyDictionary lookup makes a weak reference each time), each
        # entry dropped by a finalizer when its sequence is collected
        self._rows: dict[int, list] = {}

    def row(self, seq) -> np.ndarray:
        """seq's row [pages] int32 (numpy: a torch setitem costs ~5 us, numpy's ~0.1 us)."""
        table = seq.block_table
        kept = self._rows.get(seq.seq_id)
        if kept is None or kept[0] is not table or len(table) < kept[1]:
            if kept is None:
                weakref.finalize(seq, self._rows.pop, seq.seq_id, None)
            kept = self._rows[seq.seq_id] = [table, 0, self.padding.numpy().copy()]
        _, k, row = kept
        if len(table) > k:
            row[k : len(table)] = table[k:]
            kept[1] = len(table)
        return row
