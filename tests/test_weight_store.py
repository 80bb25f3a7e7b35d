"""engine/weight_store.py and engine/weight_files.py: hub per-expert names, all-or-nothing
updates, declared-update checks, update_weights_from_disk, release/resume of weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import SHAPES
from omni_transformers import needs_omni_transformers
from safetensors.torch import load_file, save_file

from samebits import LLM, SamplingParams
from samebits.engine import weight_files
from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.qwen3_moe.loader import load_state_dict
from samebits.model.qwen3_moe.tiny import build_tiny_checkpoint, to_per_expert

SHAPE = "bias_per_expert"  # per-expert layout on disk, 3 experts, a dense layer 0
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"
DOWN = "model.layers.1.mlp.experts.down_proj"
GATE1 = "model.layers.1.mlp.experts.1.gate_proj.weight"
PROMPTS = [[3, 4, 5], [7, 1, 9, 2]]
PARAMS = [SamplingParams(max_tokens=10, seed=s, temperature=1.0, ignore_eos=True) for s in (1, 2)]


def _llm(path, **kw) -> LLM:
    return LLM(path, max_model_len=64, max_num_seqs=2, **kw)


def _outs(llm):
    return [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, PARAMS)]


def _same_outs(a, b) -> bool:
    return all(ta == tb and torch.equal(la, lb) for (ta, la), (tb, lb) in zip(a, b, strict=True))


def _snapshot(llm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm._params.items()}


def _uses(t: torch.Tensor) -> int:
    """How many references hold `t`'s storage (a freed parameter leaves only ours)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _unchanged(llm, snap) -> bool:
    return all(torch.equal(p, snap[n]) for n, p in llm._params.items())


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A checkpoint of the same shape with other values: sharded, per-expert layout."""
    path = tmp_path_factory.mktemp("other") / "ckpt"
    return build_tiny_checkpoint(path, seed=77, per_expert_layout=True, max_shard_size="40KB", **SHAPES[SHAPE])


@pytest.fixture(scope="module")
def other_state(other):
    return load_state_dict(other, dtype=torch.bfloat16)[1]  # fused names


# --- per-expert names -----------------------------------------------------------------------


def test_per_expert_update_equals_fused_update_bitwise(checkpoints, other_state):
    fused, per_expert = _llm(checkpoints[SHAPE]), _llm(checkpoints[SHAPE])
    before = _outs(fused)
    fused.update_weights(other_state)
    per_expert.update_weights(to_per_expert(other_state))
    assert _unchanged(per_expert, _snapshot(fused))
    after = _outs(fused)
    assert _same_outs(after, _outs(per_expert))
    assert not _same_outs(after, before)  # the update changed the outputs


def test_negative_control_gate_and_up_swapped_is_another_model(checkpoints, other_state):
    """The slices matter: gate written as up (and up as gate) gives other parameters."""
    llm = _llm(checkpoints[SHAPE])
    swapped = {}
    for name, t in to_per_expert(other_state).items():
        swapped[name.replace("gate_proj", "tmp").replace("up_proj", "gate_proj").replace("tmp", "up_proj")] = t
    llm.update_weights(swapped)
    assert not torch.equal(llm._params[GATE_UP], other_state[GATE_UP])


def _bad_requests(llm, good: dict) -> dict:
    """name -> (extra (name, tensor) pair appended after a full good update, error, words)."""
    gate = good[GATE1]
    nan = gate.clone()
    nan[0, 1] = float("nan")
    return {
        "unknown": (("model.layers.1.mlp.experts.1.gate_prj.weight", gate), KeyError, "gate_prj"),
        "expert_out_of_range": (("model.layers.1.mlp.experts.3.up_proj.weight", gate), KeyError, "3 experts"),
        "dense_layer_expert": (("model.layers.0.mlp.experts.0.up_proj.weight", gate), KeyError, "layers.0"),
        "shape": (("model.layers.1.mlp.experts.2.down_proj.weight", gate), ValueError, "expected (56, "),
        "dtype": (("model.layers.1.mlp.experts.2.up_proj.weight", gate.float()), ValueError, "torch.bfloat16"),
        "nan": (("model.layers.1.mlp.experts.2.up_proj.weight", nan), ValueError, "NaN or inf"),
        "fused_overlap": ((GATE_UP, llm._params[GATE_UP] + 1), ValueError, GATE_UP),
    }


@pytest.mark.parametrize(
    "case", ["unknown", "expert_out_of_range", "dense_layer_expert", "shape", "dtype", "nan", "fused_overlap"]
)
def test_a_bad_request_leaves_every_parameter_bitwise_unchanged(checkpoints, other_state, case):
    llm = _llm(checkpoints[SHAPE])
    good = to_per_expert(other_state)
    good.pop("model.layers.1.mlp.experts.2.up_proj.weight")  # so the bad ones below are not duplicates
    good.pop("model.layers.1.mlp.experts.2.down_proj.weight")
    (name, tensor), error, words = _bad_requests(llm, good)[case]
    snap = _snapshot(llm)
    with pytest.raises(error, match="update_weights") as info:
        llm.update_weights([*good.items(), (name, tensor)])
    assert words in str(info.value) and name.split(".")[-2] in str(info.value)
    assert _unchanged(llm, snap)
    llm.update_weights(good)  # negative control: without the bad tensor the same request changes weights
    assert not _unchanged(llm, snap)


def test_a_name_given_twice_is_refused_and_changes_nothing(checkpoints, other_state):
    llm = _llm(checkpoints[SHAPE])
    pairs = list(to_per_expert(other_state).items())
    snap = _snapshot(llm)
    with pytest.raises(ValueError, match=rf"update_weights: {GATE1} given more than once"):
        llm.update_weights([*pairs, (GATE1, dict(pairs)[GATE1] + 1)])
    assert _unchanged(llm, snap)


@pytest.mark.parametrize("case", ["unknown", "expert_out_of_range", "shape", "dtype", "fused_overlap"])
def test_check_names_refuses_the_same_declared_updates_without_data(checkpoints, other_state, case):
    llm = _llm(checkpoints[SHAPE])
    good = to_per_expert(other_state)
    good.pop("model.layers.1.mlp.experts.2.up_proj.weight")
    good.pop("model.layers.1.mlp.experts.2.down_proj.weight")
    pairs = [*good.items(), _bad_requests(llm, good)[case][0]]
    with pytest.raises((KeyError, ValueError)) as declared:
        llm.weight_store.check_names(
            [n for n, _ in pairs], [t.dtype for _, t in pairs], [t.shape for _, t in pairs]
        )
    with pytest.raises((KeyError, ValueError)) as given:
        llm.update_weights(pairs)
    assert type(declared.value) is type(given.value) and str(declared.value) == str(given.value)


def test_check_names_accepts_a_good_declared_update_and_param_specs_describe_the_model(checkpoints):
    llm = _llm(checkpoints[SHAPE])
    specs = llm.weight_store.param_specs()
    assert set(specs) == set(llm._params)
    assert (
        specs[GATE_UP]
        == ((3, 2 * 48, 56), torch.bfloat16)
        == (tuple(llm._params[GATE_UP].shape), torch.bfloat16)
    )
    slots = llm.weight_store.check_names([GATE1, DOWN], [torch.bfloat16] * 2, [(48, 56), (3, 56, 48)])
    assert [(s.param, s.expert, s.part) for s in slots] == [(GATE_UP, 1, "gate"), (DOWN, None, None)]
    with pytest.raises(ValueError, match="one entry per tensor"):
        llm.weight_store.check_names([GATE1], [], [(48, 56)])


# --- update_weights_from_disk -------------------------------------------------------------------


def test_from_disk_own_checkpoint_changes_nothing(checkpoints):
    llm = _llm(checkpoints[SHAPE])
    snap, before = _snapshot(llm), _outs(llm)
    llm.update_weights_from_disk(checkpoints[SHAPE])
    assert _unchanged(llm, snap) and _same_outs(_outs(llm), before)


def test_from_disk_another_checkpoint_equals_a_fresh_engine_on_it(checkpoints, other):
    llm = _llm(checkpoints[SHAPE])
    before = _outs(llm)
    llm.update_weights_from_disk(other)
    fresh = _llm(other)
    assert _unchanged(llm, _snapshot(fresh))
    assert _same_outs(_outs(llm), _outs(fresh))
    assert not _same_outs(before, _outs(fresh))  # the two checkpoints do differ
    assert llm.path == checkpoints[SHAPE]  # the config and tokenizer stay the original's


def test_from_disk_casts_an_fp32_checkpoint_as_the_loader_does(checkpoints):
    llm = _llm(checkpoints["mixed"])  # bf16 engine
    llm.update_weights_from_disk(checkpoints["fp32"])
    assert llm.weight_digests() == _llm(checkpoints["fp32"]).weight_digests()


def _poison_last_shard(src, dst):
    path = shutil.copytree(src, dst)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    last = sorted(set(index.values()))[-1]
    state = load_file(path / last)
    name = sorted(state)[-1]
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(path / last), metadata={"format": "pt"})
    first = [n for n, f in index.items() if f == sorted(set(index.values()))[0]]
    return path, name, first


def test_from_disk_nan_in_the_last_shard_leaves_the_old_weights_bitwise(checkpoints, other, tmp_path):
    path, poisoned, first_shard = _poison_last_shard(other, tmp_path / "nan")
    llm = _llm(checkpoints[SHAPE])
    snap, before = _snapshot(llm), _outs(llm)
    with pytest.raises(UnsupportedCheckpointError, match=rf"NaN or inf: {poisoned}"):
        llm.update_weights_from_disk(path)
    assert _unchanged(llm, snap) and _same_outs(_outs(llm), before)
    # negative control: a one-pass loader would have written the first shard's tensors by then,
    # and they differ from the engine's (so the assertion above would have caught it)
    ours = llm.weight_store
    fresh = _snapshot(_llm(other))
    touched = {ours.slot(n, "t").param for n in first_shard}
    assert any(not torch.equal(snap[p], fresh[p]) for p in touched)


def test_from_disk_refuses_another_shape_before_reading_any_tensor(checkpoints, monkeypatch):
    llm = _llm(checkpoints[SHAPE])
    snap = _snapshot(llm)
    monkeypatch.setattr(weight_files, "_read", lambda *a: pytest.fail("read tensor data"))
    with pytest.raises(
        UnsupportedCheckpointError, match=r"another model shape \(hidden_size: engine 56, checkpoint"
    ):
        llm.update_weights_from_disk(checkpoints["mixed"])
    assert _unchanged(llm, snap)


def test_from_disk_refuses_a_missing_tensor_before_reading_any(checkpoints, tmp_path, monkeypatch):
    path = shutil.copytree(checkpoints[SHAPE], tmp_path / "incomplete")
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.experts.2.down_proj.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    llm = _llm(checkpoints[SHAPE])
    monkeypatch.setattr(weight_files, "_read", lambda *a: pytest.fail("read tensor data"))
    with pytest.raises(UnsupportedCheckpointError, match=rf"lacks .* 1 tensor\(s\) .*: {DOWN}"):
        llm.update_weights_from_disk(path)


# --- release / resume -----------------------------------------------------------------------


def test_release_frees_resume_refuses_until_pushed_then_bitwise_the_same(checkpoints):
    llm = _llm(checkpoints[SHAPE])
    snap, before = _snapshot(llm), _outs(llm)
    # one tensor per storage (a layer's q/k/v weights are views of one buffer)
    held = list(
        {
            p.untyped_storage().data_ptr(): p.data for p in map(llm._params.get, llm.weight_store.all_units())
        }.values()
    )
    alone = _uses(torch.ones(1))  # a storage no one else holds
    assert all(_uses(t) > alone for t in held)  # negative control: the engine holds them now
    llm.release_memory_occupation(["weights"])
    assert all(p.numel() == 0 and p.untyped_storage().nbytes() == 0 for p in llm._params.values())
    assert [_uses(t) for t in held] == [alone] * len(held)  # only `held` is left: freed once dropped
    del held
    for call in (lambda: llm.generate(PROMPTS, PARAMS), lambda: llm.update_weights({}), llm.weight_digests):
        with pytest.raises(RuntimeError, match="released"):
            call()
    llm.resume_memory_occupation(["weights"])
    from samebits.kernels.matmul import adjacent_rows  # q/k/v back to back again: one GEMM on CUDA

    assert adjacent_rows([llm._params[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]) is not None
    n = len(llm.weight_store.all_units())
    with pytest.raises(RuntimeError, match=rf"generate: {n} of {n} weight tensor\(s\) are not loaded"):
        llm.generate(PROMPTS, PARAMS)
    with pytest.raises(RuntimeError, match="add_request: .* not loaded"):
        llm.core.add_request("a", PROMPTS[0], PARAMS[0])
    pairs = list(to_per_expert(snap).items())
    last = pairs.pop()  # one expert slice still missing: its fused tensor is not loaded yet
    llm.update_weights(pairs)
    assert llm.weight_store.num_missing == 1
    with pytest.raises(RuntimeError, match=r"weight_digests: 1 tensor\(s\) not loaded"):
        llm.weight_digests()
    with pytest.raises(RuntimeError, match=r"generate: 1 of"):
        llm.generate(PROMPTS, PARAMS)
    llm.update_weights([last])
    assert _unchanged(llm, snap) and _same_outs(_outs(llm), before)


def test_resume_then_from_disk_serves_again(checkpoints):
    llm = _llm(checkpoints[SHAPE])
    before = _outs(llm)
    llm.release_memory_occupation()  # both tags
    assert llm.asleep and llm.weight_store.released
    llm.resume_memory_occupation()
    assert not llm.asleep and llm.weight_store.num_missing > 0
    llm.update_weights_from_disk(checkpoints[SHAPE])
    assert _same_outs(_outs(llm), before)


def test_resume_without_release_keeps_the_weights(checkpoints):
    llm = _llm(checkpoints[SHAPE])
    snap = _snapshot(llm)
    llm.resume_memory_occupation(["weights"])
    assert llm.weight_store.num_missing == 0 and _unchanged(llm, snap)


def test_kv_cache_tag_is_sleep(checkpoints):
    llm = _llm(checkpoints[SHAPE])
    before = _outs(llm)
    llm.release_memory_occupation(["kv_cache"])
    assert llm.runner.kv_caches == [] and llm.weight_store.num_missing == 0
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, PARAMS)
    llm.resume_memory_occupation(["kv_cache"])
    assert _same_outs(_outs(llm), before)


def test_release_refusals(checkpoints):
    llm = _llm(checkpoints[SHAPE])
    for tags in (["weights", "kv"], "weights"):
        with pytest.raises(ValueError, match=r"valid tags are \['kv_cache', 'weights'\]|list of"):
            llm.release_memory_occupation(tags)
    llm.core.add_request("busy", PROMPTS[0], PARAMS[0])
    with pytest.raises(RuntimeError, match="release_memory_occupation: 1 requests are in flight"):
        llm.release_memory_occupation(["weights"])
    assert not llm.weight_store.released
    shared = _llm(checkpoints[SHAPE], weights=llm.model.named_parameters())
    with pytest.raises(RuntimeError, match=r"shared tensors \(LLM\(weights=...\)\)"):
        shared.release_memory_occupation()
    assert not shared.asleep and all(p.numel() > 0 for p in shared._params.values())  # nothing released


def test_every_weight_change_calls_the_after_hook(checkpoints, other_state):
    llm = _llm(checkpoints[SHAPE])
    calls = []
    llm._after_weights_changed = lambda: calls.append(1)
    llm.update_weights(other_state)
    llm.update_weights(to_per_expert(other_state))
    llm.update_weights_from_disk(checkpoints[SHAPE])
    llm.release_memory_occupation(["weights"])
    llm.resume_memory_occupation(["weights"])
    assert len(calls) == 4


@pytest.mark.gpu
def test_cuda_release_frees_memory_and_graphs_replay_the_pushed_weights(checkpoints, other):
    llm = _llm(checkpoints[SHAPE], device="cuda")
    before = _outs(llm)  # decode steps captured as CUDA graphs
    snap = {n: t.cpu() for n, t in _snapshot(llm).items()}
    used = torch.cuda.memory_allocated()
    llm.release_memory_occupation(["weights"])
    freed = used - torch.cuda.memory_allocated()
    assert freed >= sum(snap[n].numel() * snap[n].element_size() for n in llm.weight_store.all_units())
    llm.resume_memory_occupation(["weights"])
    llm.update_weights({n: t.cuda() for n, t in snap.items()})
    assert _same_outs(_outs(llm), before)
    llm.update_weights_from_disk(other)
    fresh = _llm(other, device="cuda")
    assert _same_outs(_outs(llm), _outs(fresh))


@needs_omni_transformers
def test_omni_thinker_per_expert_names_and_from_disk(tmp_path, checkpoints):
    """The thinker's names (`model.language_model.layers...`): per-expert updates and a
    full Omni checkpoint (per-expert, under `thinker.`) over a fused thinker-only one."""
    from samebits.model.qwen3_omni.tiny import build_tiny_omni_checkpoint

    ours = build_tiny_omni_checkpoint(tmp_path / "a", seed=0, layout="thinker", per_expert_layout=False)
    theirs = build_tiny_omni_checkpoint(tmp_path / "b", seed=5, layout="full", per_expert_layout=True)
    fresh = _llm(theirs)
    want = fresh.weight_digests()
    by_disk, by_name = _llm(ours), _llm(ours)
    assert by_disk.weight_digests() != want
    by_disk.update_weights_from_disk(theirs)
    assert by_disk.weight_digests() == want
    per_expert = to_per_expert(_snapshot(fresh))
    assert any(n.startswith("model.language_model.layers.0.mlp.experts.0.") for n in per_expert)
    by_name.update_weights(per_expert)
    assert by_name.weight_digests() == want
    with pytest.raises(
        UnsupportedCheckpointError, match="is a qwen3_omni checkpoint, but this engine runs qwen3_moe"
    ):
        _llm(checkpoints[SHAPE]).update_weights_from_disk(theirs)


def test_from_disk_a_read_failing_halfway_through_the_copy_marks_the_rest_not_loaded(
    checkpoints, other, monkeypatch
):
    llm = _llm(checkpoints[SHAPE])
    before = _outs(llm)
    read, calls = weight_files._read, []

    def failing(store, handles, e):
        calls.append(e.disk)
        if len(calls) == len(set(calls)) + 3:  # the 3rd read of pass 2
            raise OSError("disk went away")
        return read(store, handles, e)

    monkeypatch.setattr(weight_files, "_read", failing)
    with pytest.raises(OSError, match="disk went away"):
        llm.update_weights_from_disk(other)
    assert 0 < llm.weight_store.num_missing < len(llm.weight_store.all_units())
    with pytest.raises(RuntimeError, match="generate: .* not loaded"):
        llm.generate(PROMPTS, PARAMS)
    monkeypatch.setattr(weight_files, "_read", read)
    llm.update_weights_from_disk(checkpoints[SHAPE])
    assert _same_outs(_outs(llm), before)
