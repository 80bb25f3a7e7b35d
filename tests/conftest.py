"""Tiny checkpoints of several shapes, saved by transformers, loaded by the real loader."""

from __future__ import annotations

import shutil

import pytest
import torch

from samebits.model.qwen3_moe.tiny import build_tiny_checkpoint

SHAPES = {
    # dense + sparse layers mixed, GQA 2, untied
    "mixed": dict(),
    # hidden not a power of two, 5 experts top-1, GQA 1, tied embeddings. Not renormalised: a
    # renormalised top-1 weight is exactly 1 and grouped_mm would then give our bits, leaving the
    # negative control nothing to catch.
    "tied_top1": dict(
        hidden_size=72,
        num_experts=5,
        num_experts_per_tok=1,
        norm_topk_prob=False,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=18,
        tie_word_embeddings=True,
        mlp_only_layers=[],
    ),
    # 7 experts top-4, GQA 4, sparse every 2nd layer
    "step2_top4": dict(
        hidden_size=80,
        num_experts=7,
        num_experts_per_tok=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=10,
        decoder_sparse_step=2,
        mlp_only_layers=[],
        num_hidden_layers=4,
    ),
    # GQA 3, top-3 of 3, attention bias, legacy per-expert layout on disk
    "bias_per_expert": dict(
        hidden_size=56,
        num_experts=3,
        num_experts_per_tok=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        norm_topk_prob=False,
        mlp_only_layers=[0],
    ),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for i, (name, over) in enumerate(SHAPES.items()):
        out[name] = build_tiny_checkpoint(
            root / name,
            seed=10 + i,
            dtype=torch.bfloat16,
            per_expert_layout=name == "bias_per_expert",
            **over,
        )
    out["fp32"] = build_tiny_checkpoint(root / "fp32", seed=3, dtype=torch.float32)
    return out


@pytest.fixture(scope="session")
def tiny(checkpoints):
    return checkpoints["mixed"]


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory):
    """The tiny checkpoint with a tokenizer, copied once a test module (a server may write to it)."""
    from samebits.model.tiny_tokenizer import add_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-tok") / "tiny-tok"
    shutil.copytree(tiny, path)
    return add_tiny_tokenizer(path)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
