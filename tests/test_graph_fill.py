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


def _rules_outputs(llm) -> list[tuple]:
    """Two plain requests and two with rules (top-p, top log-probs) that end first."""
    prompts = [[(5 * i + j) % 200 + 1 for j in range(6 + 2 * i)] for i in range(4)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, seed=i) for i in range(2)] + [
        SamplingParams(max_tokens=14, ignore_eos=True, seed=2, top_p=0.8),
        SamplingParams(max_tokens=14, ignore_eos=True, seed=3, logprobs=2),
    ]
    outs = llm.generate(prompts, params, progress=False)
    return [(o.token_ids, o.logprobs.tolist(), o.top_logprobs) for o in outs]


class _Replayed:
    """A CUDA graph's stand-in on the CPU: `replay` recomputes the captured forward into the
    outputs the capture returned, as a replay rewrites a graph's static outputs."""

    def __init__(self, graphs: DecodeGraphs, size: int, sampled: bool, outs: tuple, stale: bool = False):
        self.graphs, self.size, self.sampled, self.outs, self.stale = graphs, size, sampled, outs, stale

    def replay(self) -> None:
        if not self.stale:
            for out, new in zip(self.outs, self.graphs._forward(self.size, self.sampled), strict=True):
                out.copy_(new)


def _graphed(tiny, monkeypatch, stale_rules_logits: bool = False):
    """Requests with and without sampling rules decoded through `DecodeGraphs.run` on the CPU
    (graphs stood in by `_Replayed`) -> (outputs, {(size, sampled)}, sample_plain calls in
    the forwards that had rules rows)."""
    from samebits.engine import sampler
    from samebits.engine.config import EngineConfig

    with monkeypatch.context() as m:  # the runner makes its graphs (and their dummy block) as on CUDA
        m.setattr(EngineConfig, "graph_sizes", lambda self: graph_sizes(self.max_num_seqs))
        llm = LLM(tiny, **KW)
    assert llm.runner.graphs is not None
    calls = {True: 0, False: 0}
    plain = cuda_graphs.sample_plain

    def counted(*a):
        calls[graphs_sampled[0]] += 1
        return plain(*a)

    graphs_sampled = [True]
    forward = DecodeGraphs._forward

    def tracked(self, size, sampled):
        graphs_sampled[0] = sampled
        return forward(self, size, sampled)

    def capture(self, size, sampled):
        outs = self._forward(size, sampled)
        return _Replayed(self, size, sampled, outs, stale=stale_rules_logits and not sampled), outs

    monkeypatch.setattr(cuda_graphs, "sample_plain", counted)
    monkeypatch.setattr(DecodeGraphs, "_forward", tracked)
    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    monkeypatch.setattr(
        sampler.Pending, "copying", lambda tokens, chosen, tops=None: sampler.Pending.done(
            sampler._results(tokens, chosen, tops), tokens.device)
    )  # fmt: skip
    return _rules_outputs(llm), set(llm.runner.graphs.graphs), calls[False]


def test_steps_with_sampling_rules_replay_a_graph_that_ends_at_the_logits(tiny, monkeypatch):
    """A decode step whose rows have rules (top-p, top log-probs) replays its size's graph
    without the fused sample (the rules path samples its logits), a step without them (once
    the rules requests end) the one with it; the outputs are the eager engine's. Control: the
    rules graph's logits left from an earlier replay (not recomputed) change the outputs."""
    want = _rules_outputs(LLM(tiny, **KW))
    got, keys, plain_in_rules_graphs = _graphed(tiny, monkeypatch)
    assert got == want
    assert {sampled for _, sampled in keys} == {True, False} and plain_in_rules_graphs == 0
    monkeypatch.undo()
    stale, _, _ = _graphed(tiny, monkeypatch, stale_rules_logits=True)
    assert stale != want
