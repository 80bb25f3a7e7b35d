"""The CUDA graphs' static inputs, filled with rows kept between steps, equal a rebuild from
the sequences every step: token ids, positions, cache slots, sampling keys, block tables,
context lengths and temperatures. Run on the CPU (the buffers are plain tensors; no graph is
captured), through a generate that preempts, so block tables are freed and rebuilt."""

from __future__ import annotations

import torch

from samebits import LLM, SamplingParams
from samebits.engine import cuda_graphs
from samebits.engine.cuda_graphs import DecodeGraphs, graph_sizes
from samebits.engine.sampler import row_inputs

KW = {"max_num_seqs": 4, "max_model_len": 64, "block_size": 4, "num_blocks": 24}


def _rebuilt(g: DecodeGraphs, batch, size: int, reqs) -> list[torch.Tensor]:
    """The buffers as a from-scratch fill makes them (the fill before rows were kept)."""
    bs, pages, dummy = g.runner.block_size, g.max_pages, g.dummy_block
    n = len(batch.chunks)
    rows = torch.zeros(7, size, dtype=torch.long)  # row 6: a step run ahead's sources (0 here)
    rows[2] = dummy * bs
    tables = torch.full((size, pages), dummy, dtype=torch.int32)
    ctx = torch.ones(size, dtype=torch.int32)
    for i, c in enumerate(batch.chunks):
        p, table = c.start, c.seq.block_table
        rows[0, i], rows[1, i], rows[2, i] = c.seq.token_ids[p], p, table[p // bs] * bs + p % bs
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        ctx[i] = p + 1
    temps, keys, random_row = row_inputs(reqs)
    rows[3:5, :n], rows[5, :n] = keys.t(), random_row.long()
    return [rows, tables, ctx, torch.cat([temps, torch.ones(size - n)])]


def _compare_every_decode_step(tiny) -> tuple[int, int, int]:
    """-> (decode steps compared, steps whose buffers differ from a rebuild, preemptions)."""
    llm = LLM(tiny, **KW)
    g = DecodeGraphs(
        llm.runner, graph_sizes(4), max_pages=KW["max_model_len"] // 4, dummy_block=KW["num_blocks"]
    )
    launch, seen = llm.runner.launch, [0, 0]

    def checked(batch, reqs, ahead=None):
        if batch.chunks and all(c.num_tokens == 1 and c.samples for c in batch.chunks):
            size = g.size_for(batch)
            g._fill(batch, size, reqs)
            got = [g.i64[:, :size], g.block_tables[:size], g.ctx_len[:size], g.temps[:size]]
            seen[0] += 1
            seen[1] += not all(
                torch.equal(a, b) for a, b in zip(got, _rebuilt(g, batch, size, reqs), strict=True)
            )
        return launch(batch, reqs, ahead)

    llm.runner.launch = checked
    prompts = [[(7 * i + j) % 200 + 1 for j in range(10 + 3 * i)] for i in range(6)]
    params = [
        SamplingParams(max_tokens=30, ignore_eos=True, seed=i, temperature=0.5 + 0.2 * i) for i in range(6)
    ]
    llm.generate(prompts, params, progress=False)
    return seen[0], seen[1], llm.scheduler.num_preemptions


def test_kept_rows_equal_a_rebuild_every_decode_step_through_preemptions(tiny):
    steps, differ, preemptions = _compare_every_decode_step(tiny)
    assert steps > 20 and preemptions > 0
    assert differ == 0


def test_control_rows_that_are_only_ever_extended_go_stale_after_a_preemption(tiny, monkeypatch):
    # the claim's reason: a preempted sequence's blocks are freed and allocated again, so its
    # row must be rebuilt; a row that is only ever extended keeps the old block ids
    def append_only(self, seq):
        known, row = self._rows.get(seq, ([], None))
        if row is None:
            known, row = [], self.padding.clone()
            self._rows[seq] = (known, row)
        table, k = seq.block_table, len(known)
        if len(table) > k:
            row[k : len(table)] = torch.tensor(table[k:], dtype=torch.int32)
            known.extend(table[k:])
        return row

    monkeypatch.setattr(cuda_graphs.TableRows, "row", append_only)
    steps, differ, preemptions = _compare_every_decode_step(tiny)
    assert preemptions > 0 and differ > 0
