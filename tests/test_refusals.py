"""Every loader refuses what it cannot serve exactly, by name, before serving anything;
lax request values and weight updates are refused with the field named (issue 17).

Each test is a reproducer: the broken input as a user would make it, the loader or call
that must refuse it (rather than accept it silently or fail opaquely), and the message it gives.
"""

from __future__ import annotations

import json
import re
import shutil
import socket

import pytest
import torch
from omni_transformers import needs_omni_transformers
from safetensors.torch import load_file, save_file

from samebits import LLM, SamplingParams, trainer
from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.hub import ModelNotFoundError, resolve_model_path
from samebits.model.qwen3_moe.loader import load_state_dict

Q = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.norm.weight"
EXTRA = "model.layers.0.mlp.shared_expert.w"


def _engine(path):
    return load_state_dict(path)


def _trainer(path):
    return trainer.load_hf_model(path)


LOADERS = {"engine": _engine, "trainer": _trainer}


def _variant(base, dest, edit):
    """A copy of checkpoint `base` at `dest` with its tensors passed through `edit(state)`."""
    shutil.copytree(base, dest)
    state = load_file(dest / "model.safetensors")
    edit(state)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _set(name, value):
    return lambda s: s.__setitem__(name, value(s[name]))


def _poison(name, value):
    def edit(s):
        t = s[name].clone()
        t.view(-1)[3] = value
        s[name] = t

    return edit


TENSOR_CASES = {  # what transformers loaded silently before: random fills, drops, casts, NaN
    "missing": (lambda s: s.pop(Q), rf"missing.*{re.escape(Q)}"),
    "missing lm_head (untied)": (lambda s: s.pop("lm_head.weight"), r"missing.*lm_head\.weight"),
    "extra": (lambda s: s.__setitem__(EXTRA, torch.zeros(4)), rf"unexpected.*{re.escape(EXTRA)}"),
    "mis-shaped": (_set(NORM, lambda t: t[:5].clone()), rf"mis-shaped.*{re.escape(NORM)}"),
    "fp64": (_set(NORM, lambda t: t.double()), rf"{re.escape(NORM)} \(F64\)"),
    "int8": (_set(Q, lambda t: t.to(torch.int8)), rf"{re.escape(Q)} \(I8\)"),
    "fp8": (_set(Q, lambda t: t.to(torch.float8_e4m3fn)), rf"{re.escape(Q)} \(F8_E4M3\)"),
    "nan": (_poison(Q, float("nan")), rf"NaN or inf.*{re.escape(Q)}"),
    "inf": (_poison(NORM, float("inf")), rf"NaN or inf.*{re.escape(NORM)}"),
    "-inf": (_poison("lm_head.weight", float("-inf")), r"NaN or inf.*lm_head\.weight"),
}  # fmt: skip


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", TENSOR_CASES)
def test_bad_tensors_refused_by_name(tiny, tmp_path, loader, case):
    edit, match = TENSOR_CASES[case]
    path = _variant(tiny, tmp_path / "bad", edit)
    with pytest.raises(UnsupportedCheckpointError, match=match):
        LOADERS[loader](path)


@pytest.mark.parametrize("loader", LOADERS)
def test_the_unbroken_copy_loads(tiny, tmp_path, loader):
    """Negative control: the same copy-and-resave path, with nothing broken, loads."""
    LOADERS[loader](_variant(tiny, tmp_path / "good", lambda s: None))


def _truncate(f):
    f.write_bytes(f.read_bytes()[:-100])


def _zero(f):
    f.write_bytes(b"")


def _header(f):
    data = f.read_bytes()
    f.write_bytes(b"\xff" * 8 + data[8:])


FILE_CASES = {"truncated": _truncate, "zero-byte": _zero, "corrupt header": _header}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", FILE_CASES)
def test_corrupt_file_refused_with_its_name(tiny, tmp_path, loader, case):
    path = shutil.copytree(tiny, tmp_path / "bad")
    FILE_CASES[case](path / "model.safetensors")
    with pytest.raises(UnsupportedCheckpointError, match=r"model\.safetensors .*corrupt or truncated"):
        LOADERS[loader](path)


def _sharded(tiny, dest):
    """The tiny checkpoint as two shards and an index."""
    from samebits.model.qwen3_moe.loader import save_state_dict

    cfg = json.loads((tiny / "config.json").read_text())
    return save_state_dict(cfg, load_file(tiny / "model.safetensors"), dest, max_shard_bytes=60_000)


@pytest.mark.parametrize("loader", LOADERS)
def test_bad_index_json_names_the_file(tiny, tmp_path, loader):
    path = _sharded(tiny, tmp_path / "bad")
    (path / "model.safetensors.index.json").write_text('{"weight_map": {')
    with pytest.raises(UnsupportedCheckpointError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        LOADERS[loader](path)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("where", ["../other/model.safetensors", "ABS", "sub/model-00001.safetensors"])
def test_index_pointing_outside_the_directory_refused(tiny, tmp_path, loader, where):
    path = _sharded(tiny, tmp_path / "ckpt")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    outside = tmp_path / "other"
    outside.mkdir()
    first = sorted(path.glob("model-*.safetensors"))[0]
    shutil.copy(first, outside / "model.safetensors")  # a readable file: only its place is wrong
    target = str(outside / "model.safetensors") if where == "ABS" else where
    name = next(n for n, f in index["weight_map"].items() if f == first.name)
    index["weight_map"][name] = target
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedCheckpointError, match=r"outside the checkpoint directory"):
        LOADERS[loader](path)


def test_shared_weights_refuse_nan(tiny):
    """The colocated path (`LLM(path, weights=...)`, `samebits rl --share-weights`) too."""
    state = load_file(tiny / "model.safetensors")
    state[Q] = state[Q].clone()
    state[Q][0, 0] = float("nan")
    with pytest.raises(ValueError, match=rf"shared weights: 1 tensor\(s\) hold NaN or inf: {re.escape(Q)}"):
        LLM(tiny, weights=state.items(), max_model_len=64)


@needs_omni_transformers
def test_omni_loader_refuses_nan_and_corrupt_files(tmp_path):
    from samebits.model.qwen3_omni.loader import load_thinker_weights
    from samebits.model.qwen3_omni.tiny import build_tiny_omni_checkpoint

    path = build_tiny_omni_checkpoint(tmp_path / "omni", layout="thinker", per_expert_layout=False)
    state = load_file(path / "model.safetensors")
    name = next(n for n in state if "audio_tower" in n and n.endswith("weight") and state[n].dim() == 2)
    bad = state | {name: state[name].clone().fill_(float("nan"))}
    save_file(bad, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedCheckpointError, match=rf"NaN or inf.*{re.escape(name.split('.', 1)[1])}"):
        load_thinker_weights(path)
    _truncate(path / "model.safetensors")
    with pytest.raises(UnsupportedCheckpointError, match=r"model\.safetensors .*corrupt or truncated"):
        load_thinker_weights(path)


# --- hub ids, from the local cache only ----------------------------------------------------


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the test tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture
def hub_cache(tiny, tmp_path, monkeypatch, no_network):
    """A fake HF cache holding `tiny-org/tiny-moe` in the hub's layout: refs/main names the
    snapshot, whose files (two shards and an index) are symlinks into ../../blobs."""
    cache = tmp_path / "hf" / "hub"
    repo = cache / "models--tiny-org--tiny-moe"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot, blobs = repo / "snapshots" / commit, repo / "blobs"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(_sharded(tiny, tmp_path / "sharded").iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return snapshot


def test_hub_id_resolves_from_the_local_cache(hub_cache, tiny):
    assert resolve_model_path("tiny-org/tiny-moe") == hub_cache
    llm = LLM("tiny-org/tiny-moe", max_model_len=64)
    assert llm.path == hub_cache and llm.config == LLM(tiny, max_model_len=64).config
    assert llm.weight_digests() == LLM(tiny, max_model_len=64).weight_digests()
    model = trainer.load_hf_model("tiny-org/tiny-moe")
    assert torch.equal(model.lm_head.weight, load_file(tiny / "model.safetensors")["lm_head.weight"])


def test_missing_hub_id_says_how_to_download(hub_cache):
    with pytest.raises(
        ModelNotFoundError, match=r"nor in the Hugging Face cache.*`hf download Qwen/Qwen3-0\.6B`"
    ):
        LLM("Qwen/Qwen3-0.6B")
    with pytest.raises(ModelNotFoundError, match=r"hf download Qwen/Qwen3-0\.6B"):
        trainer.load_hf_model("Qwen/Qwen3-0.6B")


def test_cached_snapshot_without_config_is_named(hub_cache):
    (hub_cache / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json.*hf download tiny-org/tiny-moe"):
        resolve_model_path("tiny-org/tiny-moe")


def test_path_like_names_are_paths(hub_cache, tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"^checkpoint directory .*/missing/dir does not exist$"):
        resolve_model_path(tmp_path / "missing" / "dir")
    with pytest.raises(TypeError, match="checkpoint directory or a hub id"):
        resolve_model_path(b"tiny-org/tiny-moe")


# --- lax values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"ignore_eos": "no"}, "ignore_eos"),  # a non-empty str acted as True
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"ignore_eos": None}, "ignore_eos"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seed": -1}, r"seed .*\[0, 2\*\*63\)"),
        ({"seed": 2**63}, r"seed .*\[0, 2\*\*63\)"),  # wrapped to 0 before
        ({"seed": 2**64 + 5}, r"seed .*\[0, 2\*\*63\)"),
        ({"seed": 1.0}, "seed"),
        ({"stop_token_ids": b"\x01\x02"}, "stop_token_ids"),
    ],
)
def test_sampling_params_refuse_lax_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_edges_still_accepted():
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(ignore_eos=True).ignore_eos is True
    assert SamplingParams(temperature=0).temperature == 0


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, max_num_seqs=4, max_model_len=64)


@pytest.mark.parametrize("prompt", [b"\x05\x06\x07", bytearray(b"\x05\x06")])
def test_bytes_are_not_token_ids(llm, prompt):
    with pytest.raises(ValueError, match=r"request 0: prompt must be a list of int token ids"):
        llm.generate([prompt], SamplingParams(max_tokens=2))


# --- weights --------------------------------------------------------------------------------


def test_update_weights_takes_a_mapping_like_pairs(tiny):
    a, b = LLM(tiny, max_model_len=64), LLM(tiny, max_model_len=64)
    new = {NORM: torch.full_like(a._params[NORM], 0.5), Q: torch.zeros_like(a._params[Q])}
    before = a.weight_digests([NORM])
    a.update_weights(new)
    b.update_weights(list(new.items()))
    assert a.weight_digests() == b.weight_digests()
    assert a.weight_digests([NORM]) != before  # the mapping was applied, not ignored


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_update_weights_refuses_non_finite_and_keeps_the_old_weights(llm, bad):
    before = llm.weight_digests()
    good = torch.zeros_like(llm._params[NORM])
    poisoned = torch.ones_like(llm._params[Q])
    poisoned[1, 2] = bad
    with pytest.raises(ValueError, match=rf"update_weights: 1 tensor\(s\) hold NaN or inf: {re.escape(Q)}"):
        llm.update_weights({NORM: good, Q: poisoned})
    assert llm.weight_digests() == before  # all-or-nothing: NORM was not copied either


@pytest.mark.parametrize("bad", ["model.norm.weight", b"x", 5, torch.zeros(2), [("a",)], [(5, torch.zeros(2))]])
def test_update_weights_refuses_what_is_not_named_tensors(llm, bad):
    with pytest.raises(TypeError, match=r"update_weights"):
        llm.update_weights(bad)


def test_weight_digests_takes_one_name_as_a_str(llm):
    assert llm.weight_digests(NORM) == llm.weight_digests([NORM])
    assert list(llm.weight_digests(NORM)) == [NORM]
    with pytest.raises(TypeError, match=r"weight_digests: names must be"):
        llm.weight_digests(5)
    with pytest.raises(KeyError, match=r"unknown parameter 'nope'"):
        llm.weight_digests("nope")
