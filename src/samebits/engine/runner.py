"""The only room that touches the device: the model, the KV cache, one step.

A step turns a `ScheduledBatch` into flat tokens [T], a
`PagedAttentionMetadata`, the model family's positions and step inputs
(`model/family.py`), one forward under the model's numerics profile
(`batch_invariant()` when exact), logits for the rows that sample, and sampled
(token, log-prob) pairs. The runner does not know which family it runs.
"""

from __future__ import annotations

import torch

from samebits.engine.cuda_graphs import DecodeGraphs
from samebits.engine.sampler import SampleRequest, sample
from samebits.engine.scheduler import ScheduledBatch
from samebits.model.attention import PagedAttentionMetadata
from samebits.model.family import ModelFamily, Span
from samebits.numerics.profile import EXACT


class ModelRunner:
    def __init__(
        self,
        family: ModelFamily,
        num_blocks: int,
        block_size: int,
        device,
        dtype,
        graph_sizes: tuple[int, ...] = (),
        max_model_len: int = 0,
    ):
        self.family = family
        self.model = model = family.model
        self.profile = getattr(model, "profile", EXACT)
        self.cfg = cfg = family.config
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.graphs = None
        if graph_sizes:  # one more block than the block manager hands out: the padding rows' dummy
            max_pages = -(-max_model_len // block_size)
            self.graphs = DecodeGraphs(self, graph_sizes, max_pages, dummy_block=num_blocks)
            num_blocks += 1
        slots = num_blocks * block_size
        shape = (slots, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, PagedAttentionMetadata, list[int]]:
        """-> input_ids [T], metadata, and the row in T of each chunk that samples."""
        ids, positions, slots, sample_rows = [], [], [], []
        bs = self.block_size
        row = 0
        for c in batch.chunks:
            end = c.start + c.num_tokens
            table = c.seq.block_table
            ids.extend(c.seq.token_ids[c.start : end])
            positions.extend(range(c.start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, end))
            row += c.num_tokens
            if c.samples:
                sample_rows.append(row - 1)
        dev = self.device
        common = dict(
            positions=torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
        )
        paths = self._triton_fields(batch) if dev.type == "cuda" else self._portable_fields(batch)
        meta = PagedAttentionMetadata(**common, **paths)
        return torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True), meta, sample_rows

    def _triton_fields(self, batch: ScheduledBatch) -> dict:
        chunks = batch.chunks
        pages = max(len(c.seq.block_table) for c in chunks)
        tables = torch.zeros(len(chunks), pages, dtype=torch.int32)
        starts, lens, ctx = [], [], []
        row = 0
        for i, c in enumerate(chunks):
            tables[i, : len(c.seq.block_table)] = torch.tensor(c.seq.block_table, dtype=torch.int32)
            starts.append(row)
            lens.append(c.num_tokens)
            ctx.append(c.start + c.num_tokens)
            row += c.num_tokens
        dev = self.device
        as_int = lambda xs: torch.tensor(xs, dtype=torch.int32).to(dev, non_blocking=True)  # noqa: E731
        return dict(
            block_tables=tables.to(dev, non_blocking=True),
            q_start=as_int(starts),
            q_len=as_int(lens),
            ctx_len=as_int(ctx),
            max_q_len=max(lens),
            block_size=self.block_size,
        )

    def _portable_fields(self, batch: ScheduledBatch) -> dict:
        chunks = batch.chunks
        r = max(c.num_tokens for c in chunks)
        length = max(c.start + c.num_tokens for c in chunks)
        key_slots = torch.zeros(len(chunks), length, dtype=torch.long)
        query_rows = torch.zeros(len(chunks), r, dtype=torch.long)
        query_pos = torch.zeros(len(chunks), r, dtype=torch.long)
        token_index = []
        row = 0
        for i, c in enumerate(chunks):
            end = c.start + c.num_tokens
            key_slots[i, :end] = self._slots(c.seq.block_table, 0, end)
            query_rows[i, : c.num_tokens] = torch.arange(row, row + c.num_tokens)
            query_pos[i, : c.num_tokens] = torch.arange(c.start, end)
            token_index.append(torch.arange(i * r, i * r + c.num_tokens))
            row += c.num_tokens
        return dict(
            key_slots=key_slots,
            query_rows=query_rows,
            query_pos=query_pos,
            token_index=torch.cat(token_index),
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, reqs: list[SampleRequest]) -> list[tuple[int, float]]:
        """One forward; (token, log-prob) for each sampling chunk, in chunk order."""
        spans = spans_of(batch)
        with self.profile.context():
            step = self.family.step_inputs(spans)  # {} for a plain token step (every decode step)
            size = self.graphs.size_for(batch) if self.graphs is not None and not step else None
            if size is not None:
                return self.graphs.run(batch, size, reqs, self.family.positions(spans))
            hidden, sample_rows = self.forward(batch, spans, step)
            if not sample_rows:
                return []
            logits = self.model.compute_logits(hidden[sample_rows])  # [N, V]
            return sample(logits, reqs)

    def forward(self, batch: ScheduledBatch, spans: list[Span] | None = None, step: dict | None = None):
        """The eager forward of a step -> hidden [T, H] and the row in T of each chunk that samples."""
        spans = spans_of(batch) if spans is None else spans
        step = self.family.step_inputs(spans) if step is None else step
        input_ids, meta, sample_rows = self.prepare(batch)
        positions = self.family.positions(spans).to(self.device, non_blocking=True)  # [T] or [3, T]
        return self.model(input_ids, positions, meta, self.kv_caches, **step), sample_rows

    # -- colocation: a trainer on the same device steps while the KV cache is released ------

    def release_kv_cache(self) -> None:
        """Free the KV cache tensors; `allocate_kv_cache` brings back the same size, zeroed."""
        if self.kv_caches:
            self._kv_shape = tuple(self.kv_caches[0][0].shape)  # [slots, KVH, D]
        self.kv_caches = []
        if self.graphs is not None:
            self.graphs.reset()  # they hold the old cache's addresses
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def allocate_kv_cache(self) -> None:
        """Allocate the KV cache again after `release_kv_cache` (no-op while it is allocated)."""
        if self.kv_caches:
            return
        self.kv_caches = [
            (
                torch.zeros(self._kv_shape, dtype=self.dtype, device=self.device),
                torch.zeros(self._kv_shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.cfg.num_hidden_layers)
        ]


def spans_of(batch: ScheduledBatch) -> list[Span]:
    """Each chunk as the family sees it: its request's state and token indices."""
    return [Span(c.seq.family_state, c.start, c.start + c.num_tokens) for c in batch.chunks]
