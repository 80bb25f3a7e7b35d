"""CUDA: the Omni thinker decodes in CUDA graphs with its M-RoPE rows as graph inputs, bitwise
equal to eager decode; two controls show the test sees the graph's positions."""

from __future__ import annotations

import pytest
import torch
from omni_transformers import needs_omni_transformers

from samebits import LLM, SamplingParams
from samebits.engine.cuda_graphs import DecodeGraphs
from samebits.model.qwen3_omni.tiny import audio_part, build_tiny_omni_checkpoint, image_part, make_prompt

pytestmark = [pytest.mark.gpu, needs_omni_transformers]

KINDS = ("text", "image", "video", "audio", "mixed")


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [
        make_prompt(1, [], [11]),
        make_prompt(2, [image_part(g, (1, 4, 6))], [5, 4]),
        make_prompt(3, [image_part(g, (2, 4, 4), video=True, seconds=0.5)], [3, 6]),
        make_prompt(4, [audio_part(g, 230)], [4, 3]),
        make_prompt(
            5,
            [image_part(g, (1, 2, 4)), audio_part(g, 130), image_part(g, (2, 2, 2), video=True)],
            [2, 3, 2, 5],
        ),
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni") / "c", seed=0)
    prompts = _prompts()
    params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=10 + i) for i in range(5)]
    eager = _generate(path, prompts, params, cuda_graphs=False)[1]
    return path, prompts, params, eager


def _generate(path, prompts, params, cuda_graphs):
    llm = LLM(path, device="cuda", max_num_seqs=8, max_model_len=160, cuda_graphs=cuda_graphs)
    return llm, llm.generate(prompts, params)


def _same(a, b) -> bool:
    return a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)


def test_omni_decode_in_cuda_graphs_equals_eager(setup):
    path, prompts, params, eager = setup
    llm, graphed = _generate(path, prompts, params, cuda_graphs=True)
    assert llm.runner.graphs is not None
    assert 8 in {size for size, _ in llm.runner.graphs.graphs}  # 5 rows padded to 8
    assert llm.runner.graphs.positions.shape == (3, 8)  # the M-RoPE rows are a graph input
    assert all(_same(g, e) for g, e in zip(graphed, eager, strict=True))
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts[1:3], params[1:3], strict=True)]
    assert all(_same(a, e) for a, e in zip(alone, eager[1:3], strict=True))  # graph of 1 row


def test_negative_control_graph_fed_text_row_positions(setup, monkeypatch):
    """The graph given each token's index instead of its M-RoPE rows: the visual prompts (whose
    rope_delta is not 0) differ from eager; text and audio (rope_delta 0) cannot tell."""
    path, prompts, params, eager = setup
    run = DecodeGraphs.run

    def text_rows(self, batch, size, reqs, positions, ahead=None):
        index = torch.tensor([c.start for c in batch.chunks], dtype=positions.dtype)
        return run(self, batch, size, reqs, index.expand(3, -1), ahead)

    monkeypatch.setattr(DecodeGraphs, "run", text_rows)
    wrong = dict(zip(KINDS, _generate(path, prompts, params, cuda_graphs=True)[1], strict=True))
    same = {k: _same(wrong[k], e) for k, e in zip(KINDS, eager, strict=True)}
    assert same == {"text": True, "image": False, "video": False, "audio": True, "mixed": False}, same


def test_negative_control_stale_static_positions(setup, monkeypatch):
    """Positions copied into the static buffer only once: every later replay reads stale rows."""
    path, prompts, params, eager = setup
    fill = DecodeGraphs._fill_positions

    def once(self, positions, size):
        if self.positions is None:
            fill(self, positions, size)

    monkeypatch.setattr(DecodeGraphs, "_fill_positions", once)
    wrong = _generate(path, prompts, params, cuda_graphs=True)[1]
    assert not any(_same(w, e) for w, e in zip(wrong, eager, strict=True))
