"""Impossible or unsupported configs are refused at load, by the engine and the trainer alike,
naming the file and the field; generation_config.json's eos ids reach the engine."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from omni_transformers import needs_omni_transformers

from samebits import LLM, SamplingParams, trainer
from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.families import check_checkpoint_config
from samebits.model.qwen3_moe.config import ModelConfig
from samebits.model.qwen3_omni.config import OmniConfig
from samebits.model.qwen3_omni.tiny import build_tiny_omni_checkpoint

CFG, GEN = "config.json", "generation_config.json"
QWEN3_MOE = "Qwen3MoeForCausalLM"
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
MROPE_4_5 = {"mrope_section": [4, 5]}


def _edit(**fields):
    """A config dict edit: set each field; `_drop` lists fields to remove."""
    drop = fields.pop("_drop", ())

    def edit(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in drop} | fields

    return edit


def _text(edit):
    """The same edit applied to a thinker's text_config."""
    return lambda d: d | {"text_config": edit(d["text_config"])}


def _thinker(**fields):
    return lambda d: d | fields


# (id, file, what to do to the checkpoint, regex the message must match: the field)
QWEN3_MOE_CASES = [
    ("bad_json", CFG, '{"vocab_size": 384,', r"not valid JSON .*line 1"),
    ("empty_file", CFG, "", r"not valid JSON"),
    ("json_list", CFG, "[1, 2]", r"holds a JSON list"),
    ("no_config", CFG, None, r"missing; pass a Hugging Face checkpoint"),
    ("missing_hidden_size", CFG, _edit(_drop=["hidden_size"]), r"hidden_size is missing"),
    ("missing_vocab_size", CFG, _edit(_drop=["vocab_size"]), r"vocab_size is missing"),
    ("missing_model_type", CFG, _edit(_drop=["model_type"]), r"model_type is missing"),
    ("llama", CFG, _edit(model_type="llama", architectures=["LlamaForCausalLM"]), r"model_type 'llama'"),
    ("llama_architecture", CFG, _edit(architectures=["LlamaForCausalLM"]), r"architectures \['Llama"),
    ("architectures_str", CFG, _edit(architectures=QWEN3_MOE), r"architectures is 'Qwen3MoeForCausalLM'"),
    ("classifier", CFG, _edit(architectures=["Qwen3MoeForSequenceClassification"]), r"architectures"),
    ("heads_zero", CFG, _edit(num_attention_heads=0, _drop=["head_dim"]), r"num_attention_heads is 0"),
    ("kv_heads_zero", CFG, _edit(num_key_value_heads=0), r"num_key_value_heads is 0"),
    ("heads_not_dividing", CFG, _edit(num_key_value_heads=3), r"heads \(4\).*_key_value_heads \(3\)"),
    ("sparse_step_zero", CFG, _edit(decoder_sparse_step=0), r"decoder_sparse_step is 0"),
    ("hidden_negative", CFG, _edit(hidden_size=-96), r"hidden_size is -96"),
    ("vocab_zero", CFG, _edit(vocab_size=0), r"vocab_size is 0"),
    ("layers_zero", CFG, _edit(num_hidden_layers=0), r"num_hidden_layers is 0"),
    ("layers_bool", CFG, _edit(num_hidden_layers=True), r"num_hidden_layers"),
    ("vocab_float", CFG, _edit(vocab_size=384.0), r"vocab_size"),
    ("head_dim_zero", CFG, _edit(head_dim=0), r"head_dim is 0"),
    ("head_dim_null", CFG, _edit(head_dim=None), r"head_dim is None"),
    ("head_dim_str", CFG, _edit(head_dim="24"), r"head_dim is '24'"),
    ("max_positions_zero", CFG, _edit(max_position_embeddings=0), r"max_position_embeddings is 0"),
    ("dense_width_zero", CFG, _edit(intermediate_size=0), r"intermediate_size is 0"),
    ("expert_width_zero", CFG, _edit(moe_intermediate_size=0), r"moe_intermediate_size is 0"),
    ("experts_negative", CFG, _edit(num_local_experts=-1), r"num_experts is -1"),
    ("top_k_above_experts", CFG, _edit(num_experts_per_tok=7), r"num_experts_per_tok is 7.*num_experts=6"),
    ("top_k_zero", CFG, _edit(num_experts_per_tok=0), r"num_experts_per_tok is 0"),
    ("eps_minus_one", CFG, _edit(rms_norm_eps=-1), r"rms_norm_eps"),  # int: transformers refuses
    ("eps_negative", CFG, _edit(rms_norm_eps=-1.0), r"rms_norm_eps is -1\.0"),
    ("eps_zero", CFG, _edit(rms_norm_eps=0.0), r"rms_norm_eps is 0\.0"),
    ("eps_nan", CFG, _edit(rms_norm_eps=math.nan), r"rms_norm_eps is nan"),
    ("eps_inf", CFG, _edit(rms_norm_eps=math.inf), r"rms_norm_eps is inf"),
    ("eps_str", CFG, _edit(rms_norm_eps="1e-6"), r"rms_norm_eps"),
    ("theta_negative", CFG, _edit(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), r"rope_theta"),
    ("yarn", CFG, _edit(rope_parameters=YARN), r"rope_type 'yarn'"),
    ("yarn_no_factor", CFG, _edit(rope_parameters=dict(rope_type="yarn", rope_theta=1e4)), r"rope_parameters"),
    (
        "legacy_linear_rope",
        CFG,
        _edit(_drop=["rope_parameters"], rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}),
        r"rope_type 'linear'",
    ),
    ("quantised", CFG, _edit(quantization_config={"quant_method": "fp8"}), r"quantization_config"),
    ("sliding_window", CFG, _edit(use_sliding_window=True, sliding_window=16), r"use_sliding_window"),
    ("gelu", CFG, _edit(hidden_act="gelu"), r"hidden_act 'gelu'"),
    ("mlp_only_layers_str", CFG, _edit(mlp_only_layers="1"), r"mlp_only_layers"),
    ("dtype_unknown", CFG, _edit(dtype="nonsense"), r"nonsense"),
    ("eos_outside_vocab", CFG, "no_generation_config", r"eos_token_id \[999\] outside the vocabulary"),
    ("gen_bad_json", GEN, '{"eos_token_id": ', r"not valid JSON"),
    ("gen_json_list", GEN, "[1]", r"holds a JSON list"),
    ("gen_eos_outside_vocab", GEN, '{"eos_token_id": [1, 999]}', r"eos_token_id \[999\] outside"),
    ("gen_eos_str", GEN, '{"eos_token_id": "1"}', r"eos_token_id '1' must be an integer"),
    ("gen_eos_float", GEN, '{"eos_token_id": 1.0}', r"eos_token_id 1\.0 must be an integer"),
]  # fmt: skip


def _break(src: Path, dst: Path, file: str, how) -> Path:
    """Copy checkpoint `src` to `dst` and break `file` one way (text, dict edit, or removal)."""
    shutil.copytree(src, dst)
    if how is None:
        (dst / file).unlink()
    elif how == "no_generation_config":
        (dst / GEN).unlink()
        (dst / CFG).write_text(json.dumps(json.loads((dst / CFG).read_text()) | {"eos_token_id": 999}))
    elif isinstance(how, str):
        (dst / file).write_text(how)
    else:
        (dst / file).write_text(json.dumps(how(json.loads((dst / file).read_text()))))
    return dst


def _engine(path):
    return LLM(path, max_model_len=64)


LOADERS = {"LLM": _engine, "load_hf_model": trainer.load_hf_model}


def _assert_refused(load, path: Path, file: str, field: str) -> str:
    with pytest.raises(UnsupportedCheckpointError, match=field) as err:
        load(path)
    msg = str(err.value)
    assert str(path / file) in msg, f"message does not name {path / file}: {msg}"
    return msg


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", QWEN3_MOE_CASES, ids=[c[0] for c in QWEN3_MOE_CASES])
def test_qwen3_moe_config_refused_by_engine_and_trainer(tiny, tmp_path, case, loader):
    name, file, how, field = case
    path = _break(tiny, tmp_path / name, file, how)
    _assert_refused(LOADERS[loader], path, file, field)


def test_transformers_own_refusal_is_wrapped_with_the_file(tiny, tmp_path):
    """rms_norm_eps=-1 (an int) is refused by transformers' strict config: our error names the file."""
    path = _break(tiny, tmp_path / "eps", CFG, _edit(rms_norm_eps=-1))
    msg = _assert_refused(check_checkpoint_config, path, CFG, r"transformers refused it")
    assert "rms_norm_eps" in msg and "\n" not in msg


@pytest.mark.parametrize("loader", LOADERS)
def test_good_config_still_loads(tiny, tmp_path, loader):
    """The control: the same copy, unbroken, loads in both; as does a legacy top-level rope_theta."""
    path = _break(tiny, tmp_path / "good", CFG, _edit())
    assert LOADERS[loader](path) is not None
    legacy = _break(tiny, tmp_path / "legacy", CFG, _edit(_drop=["rope_parameters"], rope_theta=1e4))
    assert check_checkpoint_config(legacy) == check_checkpoint_config(path)


def test_config_fields_come_from_transformers(tiny):
    """The view is transformers' config: each field equals AutoConfig's, eos from generation_config."""
    from transformers import AutoConfig

    ours, hf = check_checkpoint_config(tiny), AutoConfig.from_pretrained(tiny)
    assert isinstance(ours, ModelConfig)
    assert (ours.hidden_size, ours.num_experts, ours.head_dim) == (hf.hidden_size, hf.num_experts, hf.head_dim)
    assert ours.rope_theta == hf.rope_parameters["rope_theta"] and ours.mlp_only_layers == (1,)
    assert ours.eos_token_id == (1,)


# -- eos from generation_config.json -----------------------------------------------------


def _with_eos(tiny, path: Path, gen_eos) -> Path:
    """tiny with config.json's eos 1 kept and generation_config.json's eos set (None: no file)."""
    shutil.copytree(tiny, path)
    if gen_eos is None:
        (path / GEN).unlink()
    else:
        gen = json.loads((path / GEN).read_text())
        (path / GEN).write_text(json.dumps(gen | {"eos_token_id": gen_eos}))
    return path


def test_generation_config_eos_stops_a_request(tiny, tmp_path):
    prompt = [[5, 6, 7, 8]]
    greedy = SamplingParams(temperature=0, max_tokens=20)
    free = _engine(tiny).generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_at = next(t for t in free.token_ids[3:] if t != 1)  # an eos config.json does not list
    first = free.token_ids.index(stop_at)
    assert 1 not in free.token_ids[: first + 1], "pick a prompt whose greedy output reaches stop_at first"

    llm = _engine(_with_eos(tiny, tmp_path / "gen_eos", [stop_at, 1]))
    assert llm.config.eos_token_id == (stop_at, 1)
    out = llm.generate(prompt, greedy)[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    # control: without generation_config.json config.json's eos (1) alone applies and the request runs on
    plain = _engine(_with_eos(tiny, tmp_path / "no_gen", None))
    assert plain.config.eos_token_id == (1,)
    assert plain.generate(prompt, greedy)[0].token_ids[: first + 2] == free.token_ids[: first + 2]


def test_generation_config_eos_takes_precedence_as_in_transformers(tiny, tmp_path):
    """transformers' generate reads only generation_config.json's eos when the file exists."""
    from transformers import AutoModelForCausalLM

    path = _with_eos(tiny, tmp_path / "int_eos", 7)
    assert check_checkpoint_config(path).eos_token_id == (7,)
    assert AutoModelForCausalLM.from_pretrained(path).generation_config.eos_token_id == 7


# -- Qwen3-Omni thinker --------------------------------------------------------------------


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    root = tmp_path_factory.mktemp("omni_cfg")
    return {
        "thinker": build_tiny_omni_checkpoint(root / "thinker", seed=5, layout="thinker"),
        "full": build_tiny_omni_checkpoint(root / "full", seed=5, layout="full"),
    }


OMNI_CASES = [
    ("text_eps_negative", _text(_edit(rms_norm_eps=-1.0)), r"text_config\.rms_norm_eps is -1\.0"),
    ("text_missing_hidden", _text(_edit(_drop=["hidden_size"])), r"text_config\.hidden_size is missing"),
    ("text_top_k", _text(_edit(num_experts_per_tok=9)), r"text_config\.num_experts_per_tok is 9"),
    ("text_heads", _text(_edit(num_key_value_heads=3)), r"text_config\.num_attention_heads \(4\)"),
    ("text_yarn", _text(_edit(rope_parameters=YARN)),
     r"text_config\.rope_parameters\.rope_type 'yarn'"),
    ("mrope_section", _text(lambda t: t | {"rope_parameters": t["rope_parameters"] | MROPE_4_5}),
     r"mrope_section \[4, 5\]"),
    ("no_text_config", lambda d: {k: v for k, v in d.items() if k != "text_config"}, r"text_config is missing"),
    ("image_token_outside_vocab", _thinker(image_token_id=999), r"image_token_id is 999"),
    ("quantised", _thinker(quantization_config={"quant_method": "awq"}), r"quantization_config"),
]  # fmt: skip

OMNI_LOADERS = {"LLM": _engine, "load_hf_thinker": trainer.load_hf_thinker}


def _break_omni(src: Path, dst: Path, edit, layout: str) -> Path:
    if layout == "thinker":
        return _break(src, dst, CFG, edit)
    return _break(src, dst, CFG, lambda d: d | {"thinker_config": edit(d["thinker_config"])})


@pytest.mark.parametrize("loader", OMNI_LOADERS)
@pytest.mark.parametrize("layout", ["thinker", "full"])
@pytest.mark.parametrize("case", OMNI_CASES, ids=[c[0] for c in OMNI_CASES])
@needs_omni_transformers
def test_omni_config_refused_by_engine_and_trainer(omni, tmp_path, case, layout, loader):
    name, edit, field = case
    path = _break_omni(omni[layout], tmp_path / name, edit, layout)
    field = field if layout == "thinker" else r"thinker_config\.(.*)" + field
    _assert_refused(OMNI_LOADERS[loader], path, CFG, field)


@pytest.mark.parametrize("layout", ["thinker", "full"])
def test_omni_model_type_must_match_architectures(omni, tmp_path, layout):
    other = {
        "thinker": "Qwen3OmniMoeForConditionalGeneration",
        "full": "Qwen3OmniMoeThinkerForConditionalGeneration",
    }
    path = _break(omni[layout], tmp_path / "mismatch", CFG, _edit(architectures=[other[layout]]))
    _assert_refused(check_checkpoint_config, path, CFG, r"architectures .* do not match model_type")


@needs_omni_transformers
def test_full_omni_without_thinker_config_refused(omni, tmp_path):
    path = _break(omni["full"], tmp_path / "no_thinker", CFG, _edit(_drop=["thinker_config"]))
    _assert_refused(check_checkpoint_config, path, CFG, r"thinker_config\.text_config is missing")


@pytest.mark.parametrize("layout", ["thinker", "full"])
@needs_omni_transformers
def test_omni_good_config_loads(omni, layout):
    cfg = check_checkpoint_config(omni[layout])
    assert isinstance(cfg, OmniConfig) and cfg.mrope_section == (4, 4, 4)
    assert cfg.text.eos_token_id == (1,) and cfg.text.num_experts == 6
    assert cfg.hf_thinker_config().text_config.num_experts == 6
