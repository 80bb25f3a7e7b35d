"""Loaded tensors equal transformers' own, for every test shape (refusals: test_loader.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from samebits.model.loader import expected_shapes, load_state_dict
from samebits.model.tiny import TINY_SHAPE


def _hf_state(path, dtype):
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype)
    return {k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", ["mixed", "tied_top1", "step2_top4", "bias_per_expert", "fp32"])
def test_loaded_tensors_equal_transformers_own(checkpoints, case):
    path = checkpoints[case]
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    cfg, state = load_state_dict(path)
    hf = _hf_state(path, dtype)
    assert set(state) == set(expected_shapes(cfg))
    for name, t in state.items():
        assert t.dtype == dtype
        assert torch.equal(t, hf[name]), name
    if cfg.tie_word_embeddings:
        assert state["lm_head.weight"] is state["model.embed_tokens.weight"]


def test_sharded_checkpoint(tmp_path):
    cfg = Qwen3MoeConfig(**TINY_SHAPE)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _, state = load_state_dict(tmp_path)
    ref = model.state_dict()
    assert all(torch.equal(state[k], ref[k]) for k in state)


def test_cast_on_load(checkpoints):
    _, state = load_state_dict(checkpoints["fp32"], dtype=torch.bfloat16)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
