"""The runner for the Qwen3-Omni thinker: the Qwen3-MoE step plus M-RoPE rows and encoder features.

`prepare` builds the text step as `ModelRunner.prepare` does (chunks in order, each chunk's
tokens contiguous in T) and adds, per chunk, its [3, n] positions and the encoder features of
the placeholder rows it covers. A sequence's encoders run once, at its first prefill chunk
(under `batch_invariant()`, as the trainer runs them); after a preemption its features are
reused.
"""

from __future__ import annotations

import dataclasses

import torch

from samebits.engine.multimodal import encode
from samebits.engine.runner import ModelRunner
from samebits.engine.scheduler import ScheduledBatch
from samebits.model.omni import MultimodalRows, OmniBatchMetadata
from samebits.numerics.batch_invariant import batch_invariant


class OmniModelRunner(ModelRunner):
    def prepare(self, batch: ScheduledBatch):
        input_ids, meta, sample_rows = super().prepare(batch)
        positions, rows, embeds, visual, deep = [], [], [], [], []
        row = 0
        for c in batch.chunks:
            state = c.seq.multimodal
            start, end = c.start, c.start + c.num_tokens
            positions.append(state.positions_for(start, end))
            if state.needs_encoding:
                with batch_invariant():
                    encode(state, self.model, self.model.omni)
            in_chunk = (state.feature_index >= start) & (state.feature_index < end)
            if bool(in_chunk.any()):
                rows.append(state.feature_index[in_chunk] - start + row)
                embeds.append(state.embeds[in_chunk.to(state.embeds.device)])
            vis = (state.visual_index >= start) & (state.visual_index < end)
            if bool(vis.any()):
                visual.append(state.visual_index[vis] - start + row)
                deep.append([level[vis.to(level.device)] for level in state.deepstack])
            row += c.num_tokens
        meta_fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
        omni_meta = OmniBatchMetadata(
            **meta_fields,
            mrope_positions=torch.cat(positions, dim=1).to(self.device),
            multimodal=self._rows(row, rows, embeds, visual, deep),
        )
        return input_ids, omni_meta, sample_rows

    def _rows(self, total, rows, embeds, visual, deep) -> MultimodalRows | None:
        if not rows:
            return None
        dev = self.device
        mask = torch.zeros(total, dtype=torch.bool)
        if visual:
            mask[torch.cat(visual)] = True
        levels = tuple(torch.cat(parts).to(dev) for parts in zip(*deep, strict=True)) if deep else ()
        return MultimodalRows(
            rows=torch.cat(rows).to(dev),
            embeds=torch.cat(embeds).to(dev),
            visual_mask=mask.to(dev),
            deepstack=levels,
        )
