"""The only room that touches the device: the model, the KV cache, one step.

A step turns a `ScheduledBatch` into flat tokens [T], an
`AttentionBatch`, the model family's positions and step inputs
(`model/family.py`), one forward under the model's numerics profile
(`batch_invariant()` when exact), logits for the rows that sample, and sampled
(token, log-prob) pairs. The runner does not know which family it runs.
"""

from __future__ import annotations

import torch

from samebits.engine.cuda_graphs import DecodeGraphs
from samebits.engine.sampler import Pending, SampleRequest, sample
from samebits.engine.scheduler import ScheduledBatch
from samebits.model.attention import AttentionBatch
from samebits.model.family import ModelFamily, Span
from samebits.numerics.profile import EXACT, Profile

Ahead = tuple[list[int], torch.Tensor]  # (row of the previous step's samples per chunk, those samples)


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
        profile: Profile = EXACT,
    ):
        self.family = family
        self.model = family.model
        self.profile = profile  # entered around each step: selects the ops' implementations
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

    def prepare(
        self, batch: ScheduledBatch, ahead: Ahead | None = None
    ) -> tuple[torch.Tensor, AttentionBatch, list[int]]:
        """-> input_ids [T], metadata, and the row in T of each chunk that samples."""
        chunks = batch.chunks
        meta = AttentionBatch.build(
            [c.seq.block_table for c in chunks],
            [c.start for c in chunks],
            [c.num_tokens for c in chunks],
            self.block_size,
            self.device,
        )
        if ahead is not None:  # one-token decode chunks whose input ids are on the device
            src, tokens = ahead
            input_ids = tokens.index_select(0, torch.tensor(src, device=tokens.device)).to(self.device)
            return input_ids, meta, list(range(len(chunks)))
        ids, sample_rows = [], []
        for c in chunks:
            ids.extend(c.seq.token_ids[c.start : c.start + c.num_tokens])
            if c.samples:
                sample_rows.append(len(ids) - 1)
        return torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True), meta, sample_rows

    def run(self, batch: ScheduledBatch, reqs: list[SampleRequest]) -> list[tuple[int, float]]:
        """One forward; (token, log-prob) for each sampling chunk, in chunk order."""
        return self.launch(batch, reqs).result()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, reqs: list[SampleRequest], ahead: Ahead | None = None) -> Pending:
        """Start one step -> its samples, a `Pending` (on CUDA graphs the host does not wait
        for the step: async scheduling prepares the next one meanwhile). `ahead` = (src,
        tokens): a batch scheduled before its input ids were known (engine/core.py), every
        chunk a one-token decode whose input id is tokens[src[i]], the previous step's
        samples on the device."""
        spans = spans_of(batch)
        with self.profile.context():
            step = self.family.step_inputs(spans)  # {} for a plain token step (every decode step)
            size = self.graphs.size_for(batch) if self.graphs is not None and not step else None
            if size is not None:
                return self.graphs.run(batch, size, reqs, self.family.positions(spans), ahead)
            hidden, sample_rows = self.forward(batch, spans, step, ahead)
            if not sample_rows:
                return Pending.done([], self.device)
            logits = self.model.compute_logits(hidden[sample_rows])  # [N, V]
            return Pending.done(sample(logits, reqs), self.device)

    def forward(
        self,
        batch: ScheduledBatch,
        spans: list[Span] | None = None,
        step: dict | None = None,
        ahead: Ahead | None = None,
    ):
        """The eager forward of a step -> hidden [T, H] and the row in T of each chunk that samples."""
        spans = spans_of(batch) if spans is None else spans
        step = self.family.step_inputs(spans) if step is None else step
        input_ids, meta, sample_rows = self.prepare(batch, ahead)
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
