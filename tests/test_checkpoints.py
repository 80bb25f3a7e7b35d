"""Loaded tensors equal transformers' own, for every test shape (refusals: test_loader.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from samebits.model.qwen3_moe.loader import expected_shapes, load_state_dict
from samebits.model.qwen3_moe.tiny import TINY_SHAPE


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


def test_config_defaults_follow_transformers():
    """A config.json that omits a field means transformers' default, not ours."""
    from samebits.model.qwen3_moe.config import ModelConfig

    d = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
    }
    ours, hf = ModelConfig.from_dict(d), Qwen3MoeConfig(**{k: v for k, v in d.items() if k != "architectures"})
    assert ours.norm_topk_prob == hf.norm_topk_prob
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.num_key_value_heads == hf.num_key_value_heads
    assert ours.rms_norm_eps == hf.rms_norm_eps
