"""The loader against transformers' own checkpoints: every layout loads to the HF
model's exact tensors, and every bad checkpoint is refused by name."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.qwen3_moe.loader import expected_shapes, load_state_dict, save_state_dict
from samebits.model.qwen3_moe.tiny import build_tiny_checkpoint, build_tiny_model, to_per_expert

SHAPES = {
    "mixed": {},  # sparse, dense, sparse (mlp_only_layers=[1])
    "odd": dict(  # hidden, experts, heads, head_dim not powers of two
        hidden_size=72, num_experts=5, num_experts_per_tok=3, num_attention_heads=3,
        num_key_value_heads=1, head_dim=20, moe_intermediate_size=36, intermediate_size=100,
    ),
    "tied": dict(tie_word_embeddings=True, mlp_only_layers=[]),
    "step2": dict(decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=4),
    "bias": dict(attention_bias=True, num_experts=3, num_experts_per_tok=3),
}  # fmt: skip
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@functools.cache
def _reference(shape: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return build_tiny_model(seed=7, dtype=dtype, **SHAPES[shape]).state_dict()


def _disk_names(path) -> set[str]:
    names = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            names |= set(fh.keys())
    return names


def _assert_loads_to(path, ref: dict[str, torch.Tensor], dtype=None) -> dict:
    cfg, state = load_state_dict(path, dtype=dtype)
    assert list(state) == list(expected_shapes(cfg))
    assert set(state) == set(ref)
    for name, t in state.items():
        assert tuple(t.shape) == expected_shapes(cfg)[name], name
        assert t.dtype == ref[name].dtype, name
        assert torch.equal(t, ref[name]), name
    return state


# --- round trips -----------------------------------------------------------------------


def _roundtrip_cases():
    for shape in SHAPES:
        for layout in ("fused", "per_expert"):
            for sharded in (False, True):
                yield shape, layout, sharded, "bf16"
    for layout in ("fused", "per_expert"):
        yield "mixed", layout, True, "fp32"
        yield "tied", layout, False, "fp32"


@pytest.mark.parametrize("shape,layout,sharded,dtype", list(_roundtrip_cases()))
def test_loads_exactly_what_transformers_saved(tmp_path, shape, layout, sharded, dtype):
    path = build_tiny_checkpoint(
        tmp_path / "ckpt", seed=7, dtype=DTYPES[dtype], per_expert_layout=layout == "per_expert",
        max_shard_size="50KB" if sharded else None, **SHAPES[shape],
    )  # fmt: skip
    # the variants really differ on disk
    names = _disk_names(path)
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names) == (layout == "per_expert")
    assert any(n.endswith("experts.gate_up_proj") for n in names) == (layout == "fused")
    assert ("lm_head.weight" in names) == (shape != "tied")
    assert (path / "model.safetensors.index.json").is_file() == sharded
    assert (len(list(path.glob("*.safetensors"))) > 1) == sharded

    state = _assert_loads_to(path, _reference(shape, DTYPES[dtype]))
    tied = state["lm_head.weight"] is state["model.embed_tokens.weight"]
    assert tied == (shape == "tied")


@pytest.mark.parametrize("src,dst", [("bf16", "fp32"), ("fp32", "bf16")])
def test_casts_to_requested_dtype(tmp_path, src, dst):
    path = build_tiny_checkpoint(tmp_path, seed=7, dtype=DTYPES[src], per_expert_layout=True)
    ref = {n: t.to(DTYPES[dst]) for n, t in _reference("mixed", DTYPES[src]).items()}
    _assert_loads_to(path, ref, dtype=DTYPES[dst])


def test_saved_state_reads_back_in_transformers(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    src = build_tiny_checkpoint(tmp_path / "src", seed=7, per_expert_layout=True)
    _, state = load_state_dict(src)
    cfg_dict = json.loads((src / "config.json").read_text())
    out = save_state_dict(cfg_dict, state, tmp_path / "out", max_shard_bytes=60_000)
    assert len(list(out.glob("*.safetensors"))) > 1
    _assert_loads_to(out, _reference("mixed", torch.bfloat16))
    hf = Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(hf[n], t) for n, t in state.items())


def test_tied_head_saved_anyway_is_shared(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "a", seed=7, **SHAPES["tied"])
    cfg_dict, state = _fused(path)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    _, loaded = load_state_dict(save_state_dict(cfg_dict, state, tmp_path / "b"))
    assert loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"]


def test_mixed_dtypes_take_the_declared_one(tmp_path, base):
    cfg_dict, state = base
    state = {n: t.float() if n.endswith("norm.weight") else t for n, t in state.items()}
    _, loaded = load_state_dict(save_state_dict(cfg_dict, state, tmp_path / "a"))
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}
    with pytest.raises(UnsupportedCheckpointError, match=r"mixes dtypes.*pass dtype="):
        load_state_dict(save_state_dict(cfg_dict | {"dtype": "float16"}, state, tmp_path / "b"))
    _, loaded = load_state_dict(tmp_path / "b", dtype=torch.float32)
    assert {t.dtype for t in loaded.values()} == {torch.float32}


def test_ignores_rotary_buffers(tmp_path, base):
    cfg_dict, state = base
    extra = {"model.rotary_emb.inv_freq": torch.ones(12)}
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(12)
    _, loaded = load_state_dict(save_state_dict(cfg_dict, state | extra, tmp_path))
    assert not any("inv_freq" in n for n in loaded)


# --- refusals ----------------------------------------------------------------------------


def _fused(path) -> tuple[dict, dict[str, torch.Tensor]]:
    _, state = load_state_dict(path)
    return json.loads((path / "config.json").read_text()), dict(state)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """config.json dict and fused state of the mixed tiny model (bf16); copy before mutating."""
    cfg_dict, state = _fused(build_tiny_checkpoint(tmp_path_factory.mktemp("base"), seed=7))
    return cfg_dict, state


def _refused(tmp_path, cfg_dict, state, match, **save):
    save_state_dict(cfg_dict, state, tmp_path / "bad", **save)
    with pytest.raises(UnsupportedCheckpointError, match=match) as err:
        load_state_dict(tmp_path / "bad")
    return str(err.value)


def test_refuses_missing_tensor(tmp_path, base):
    cfg_dict, state = base
    state = {n: t for n, t in state.items() if n != "model.layers.1.mlp.up_proj.weight"}
    _refused(
        tmp_path,
        cfg_dict,
        state,
        r"^1 tensor\(s\) missing.*: model\.layers\.1\.mlp\.up_proj\.weight$",
    )


def test_refuses_untied_without_head(tmp_path, base):
    cfg_dict, state = base
    state = {n: t for n, t in state.items() if n != "lm_head.weight"}
    _refused(tmp_path, cfg_dict, state, r"missing.*lm_head\.weight")


def test_lists_at_most_ten_names(tmp_path, base):
    cfg_dict, state = base
    state = {n: t for n, t in state.items() if not n.startswith("model.layers.0.")}
    msg = _refused(tmp_path, cfg_dict, state, r"^11 tensor\(s\) missing.*\(and 1 more\)$")
    assert len(re.findall(r"model\.layers\.0\.", msg)) == 10


@pytest.mark.parametrize(
    "extra",
    [
        "model.layers.0.mlp.shared_expert.gate_proj.weight",  # not a Qwen3-MoE tensor
        "model.layers.1.mlp.experts.0.gate_proj.weight",  # expert in a dense layer
        "model.layers.3.input_layernorm.weight",  # a layer past num_hidden_layers
    ],
)
def test_refuses_unexpected_tensor(tmp_path, base, extra):
    cfg_dict, state = base
    state = state | {extra: torch.zeros(48, 96, dtype=torch.bfloat16)}
    _refused(tmp_path, cfg_dict, state, rf"^1 unexpected tensor\(s\).*: {re.escape(extra)};")


def test_refuses_misshaped_tensors(tmp_path, base):
    cfg_dict, state = base
    state = state | {
        "model.layers.0.self_attn.q_norm.weight": torch.ones(25, dtype=torch.bfloat16),
        "model.layers.2.mlp.experts.down_proj": torch.ones(6, 48, 96, dtype=torch.bfloat16),
    }
    msg = _refused(tmp_path, cfg_dict, state, r"^2 mis-shaped tensor\(s\)")
    assert "model.layers.0.self_attn.q_norm.weight: expected (24,), got (25,)" in msg
    assert "model.layers.2.mlp.experts.down_proj: expected (6, 96, 48), got (6, 48, 96)" in msg


def test_refuses_misshaped_expert(tmp_path, base):
    cfg_dict, state = base
    state = to_per_expert(state)
    state["model.layers.0.mlp.experts.4.up_proj.weight"] = torch.ones(47, 96, dtype=torch.bfloat16)
    _refused(
        tmp_path,
        cfg_dict,
        state,
        r"experts\.4\.up_proj\.weight: expected \(48, 96\), got \(47, 96\)",
    )


def test_refuses_missing_experts(tmp_path, base):
    cfg_dict, state = base
    state = to_per_expert(state)
    gone = ["model.layers.2.mlp.experts.3.gate_proj.weight"]
    gone += [f"model.layers.0.mlp.experts.5.{k}_proj.weight" for k in ("gate", "up", "down")]
    state = {n: t for n, t in state.items() if n not in gone}
    msg = _refused(tmp_path, cfg_dict, state, r"^per-expert layout is missing 4 expert tensor\(s\)")
    assert all(n in msg for n in gone) and "num_experts=6" in msg


def test_refuses_extra_expert_and_mixed_layouts(tmp_path, base):
    cfg_dict, state = base
    per = to_per_expert(state)
    six = "model.layers.0.mlp.experts.6.down_proj.weight"
    extra = per | {six: per["model.layers.0.mlp.experts.0.down_proj.weight"].clone()}
    _refused(tmp_path / "a", cfg_dict, extra, rf"^1 unexpected.*: {re.escape(six)};")
    both = per | {"model.layers.2.mlp.experts.down_proj": state["model.layers.2.mlp.experts.down_proj"]}
    _refused(tmp_path / "b", cfg_dict, both, r"unexpected.*: model\.layers\.2\.mlp\.experts\.down_proj;")


@pytest.mark.parametrize(
    "dtype,tag", [(torch.int8, "I8"), (torch.float8_e4m3fn, "F8_E4M3"), (torch.uint8, "U8")]
)
def test_refuses_integer_and_fp8_weights(tmp_path, base, dtype, tag):
    cfg_dict, state = base
    name = "model.layers.0.self_attn.q_proj.weight"
    state = state | {name: state[name].to(dtype)}
    _refused(
        tmp_path,
        cfg_dict,
        state,
        rf"^1 integer or quantised.*{re.escape(name)} \({tag}\);.*bf16 or fp32",
    )


def test_refuses_quantised_names(tmp_path, base):
    cfg_dict, state = base
    extra = {
        "model.layers.0.mlp.gate.qweight": torch.zeros(6, 12, dtype=torch.int32),
        "model.layers.0.mlp.gate.scales": torch.ones(6, dtype=torch.bfloat16),
    }
    msg = _refused(tmp_path, cfg_dict, state | extra, r"^2 integer or quantised")
    assert "gate.qweight (I32)" in msg and "gate.scales" in msg


def test_refuses_tied_head_that_differs(tmp_path, base):
    cfg_dict, state = base
    _refused(tmp_path, cfg_dict | {"tie_word_embeddings": True}, state, r"lm_head\.weight differs")


def test_refuses_no_weight_files(tmp_path, base):
    cfg_dict, _ = base
    (tmp_path / "config.json").write_text(json.dumps(cfg_dict))
    with pytest.raises(UnsupportedCheckpointError, match=r"no weight files found"):
        load_state_dict(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UnsupportedCheckpointError, match=r"\.bin.*safetensors only"):
        load_state_dict(tmp_path)


def test_refuses_missing_shard(tmp_path, base):
    cfg_dict, state = base
    path = save_state_dict(cfg_dict, state, tmp_path, max_shard_bytes=60_000)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(UnsupportedCheckpointError, match=rf"1 shard.*missing.*{shards[1].name}"):
        load_state_dict(path)


def test_refuses_tensor_stored_twice(tmp_path, base):
    cfg_dict, state = base
    path = save_state_dict(cfg_dict, state, tmp_path, max_shard_bytes=60_000)
    first = sorted(path.glob("model-*.safetensors"))[0]
    with safe_open(str(first), framework="pt") as fh:
        name = next(iter(fh.keys()))
    last = sorted(path.glob("model-*.safetensors"))[-1]
    with safe_open(str(last), framework="pt") as fh:
        tensors = {n: fh.get_tensor(n) for n in fh.keys()}
    save_file(tensors | {name: state[name]}, str(last))
    with pytest.raises(UnsupportedCheckpointError, match=rf"{re.escape(name)} is stored twice"):
        load_state_dict(path)


def test_save_replaces_earlier_weight_files(tmp_path, base):
    cfg_dict, state = base
    save_state_dict(cfg_dict, state, tmp_path, max_shard_bytes=60_000)
    save_state_dict(cfg_dict, state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_each_layers_q_k_v_load_back_to_back_in_one_buffer(tmp_path):
    """The loader reads a layer's q/k/v projection weights into adjacent rows of one buffer
    (what lets CUDA run them as one GEMM), with the checkpoint's values. `adjacent_rows`
    refuses weights that are not back to back."""
    from samebits.kernels.matmul import adjacent_rows

    path = build_tiny_checkpoint(tmp_path / "ck", seed=3, dtype=torch.bfloat16)
    cfg, state = load_state_dict(path)
    ref = build_tiny_model(seed=3, dtype=torch.bfloat16).state_dict()
    for i in range(cfg.num_hidden_layers):
        names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"]
        joined = adjacent_rows([state[n] for n in names])
        assert joined is not None
        assert torch.equal(joined, torch.cat([ref[n] for n in names]))
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert adjacent_rows([q, v]) is None and adjacent_rows([k, q]) is None
    assert adjacent_rows([q, k.clone(), v]) is None
