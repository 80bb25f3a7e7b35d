"""The only room that touches the device: the model, the KV cache, one step.

A step turns a `ScheduledBatch` into flat tokens [T], an
`AttentionBatch`, the model family's positions and step inputs
(`model/family.py`), one forward under the model's numerics profile
(`batch_invariant()` when exact), logits for the rows that sample, and sampled
(token, log-prob) pairs; the prompt rows of a request that asks `prompt_logprobs`
are scored there too (engine/prompt_logprobs.py; never in a CUDA graph: a graph's
rows all sample). The runner does not know which family it runs.
"""

from __future__ import annotations

import torch

from samebits.engine.cuda_graphs import DecodeGraphs
from samebits.engine.prompt_logprobs import score_batch
from samebits.engine.sampler import Pending, SampleRequest, has_fused_line, sample_pending
from samebits.engine.scheduler import ScheduledBatch
from samebits.model.attention import AttentionBatch
from samebits.model.family import ModelFamily, Span
from samebits.model.host_copy import to_device
from samebits.numerics.profile import EXACT, Profile

Ahead = tuple[list[int], torch.Tensor]  # (row of the previous step's samples per chunk or -1, those samples)


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
        self.scoring = 0  # sequences with prompt positions left to score (the engine core counts them)
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
        """-> input_ids [T], metadata, and the row in T of each chunk that samples. With
        `ahead`, a chunk whose entry in src is >= 0 is one token whose id is tokens[src[i]]
        (on the device: the previous step's samples); the other chunks' ids are known here."""
        chunks = batch.chunks
        meta = AttentionBatch.build(
            [c.seq.block_table for c in chunks],
            [c.start for c in chunks],
            [c.num_tokens for c in chunks],
            self.block_size,
            self.device,
        )
        src = ahead[0] if ahead is not None else None
        if src is not None and -1 not in src:  # every chunk a one-token decode fed on the device
            input_ids = ahead[1].index_select(0, to_device(torch.tensor(src), ahead[1].device)).to(self.device)
            return input_ids, meta, list(range(len(chunks)))
        ids, sample_rows, fed_rows, fed_src = [], [], [], []
        for i, c in enumerate(chunks):
            if src is not None and src[i] >= 0:
                fed_rows.append(len(ids))
                fed_src.append(src[i])
                ids.append(0)  # (written below from the device)
            else:
                ids.extend(c.seq.token_ids[c.start : c.start + c.num_tokens])
            if c.samples:
                sample_rows.append(len(ids) - 1)
        input_ids = to_device(torch.tensor(ids, dtype=torch.long), self.device)
        if fed_rows:
            tokens = ahead[1]
            fed = tokens.index_select(0, to_device(torch.tensor(fed_src), tokens.device)).to(self.device)
            input_ids.index_copy_(0, to_device(torch.tensor(fed_rows), self.device), fed)
        return input_ids, meta, sample_rows

    def run(self, batch: ScheduledBatch, reqs: list[SampleRequest]) -> list[tuple[int, float]]:
        """One forward; (token, log-prob) for each sampling chunk, in chunk order."""
        return self.launch(batch, reqs).result()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, reqs: list[SampleRequest], ahead: Ahead | None = None) -> Pending:
        """Start one step -> its samples, a `Pending` (on CUDA graphs the host does not wait
        for the step: async scheduling prepares the next one meanwhile). `ahead` = (src,
        tokens): a batch scheduled before some of its input ids were known (engine/core.py):
        a chunk with src[i] >= 0 is a one-token decode whose input id is tokens[src[i]], the
        previous step's samples on the device; -1 marks a chunk whose ids are known here.
        An eager step's samples are a `Pending` too: the host does not wait for the step."""
        spans = spans_of(batch)
        with self.profile.context():
            step = self.family.step_inputs(spans)  # {} for a plain token step (every decode step)
            size = self.graph_size(batch, step, ahead)
            if size is not None and not has_fused_line(reqs):  # a FusedLine row reads the hidden rows
                return self.graphs.run(batch, size, reqs, self.family.positions(spans), ahead)
            hidden, sample_rows = self.forward(batch, spans, step, ahead)
            if self.scoring:  # `prompt_logprobs` rows, while a sequence has some left to score
                self.scoring -= score_batch(self.model, hidden, batch)
            if not sample_rows:
                return Pending.done([], self.device)
            rows = to_device(torch.tensor(sample_rows), hidden.device)
            hidden = hidden.index_select(0, rows)  # [N, H]
            logits = self.model.compute_logits(hidden)  # [N, V]
            return sample_pending(logits, reqs, head=(hidden, self.model.lm_head.weight))

    def graph_size(self, batch: ScheduledBatch, step: dict, ahead: Ahead | None) -> int | None:
        """The captured size a step replays (`DecodeGraphs.size_for`), or None to run it eagerly:
        no graphs, family step inputs, or rows whose ids are known here beside rows fed on the
        device (the graphs gather every row's id from the previous step's samples)."""
        if self.graphs is None or step or (ahead is not None and -1 in ahead[0]):
            return None
        return self.graphs.size_for(batch)

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
        positions = to_device(self.family.positions(spans), self.device)  # [T] or [3, T]
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
