"""Bounded fuzz (fixed seeds): 200 random bad requests and 50 randomly broken checkpoints.

Each must end in a clear error (ValueError/TypeError, or UnsupportedCheckpointError, a
ValueError) whose message names the field, file or tensor; a bad request leaks no KV
block; and a good request afterwards gives the same bits as before the fuzzing.
"""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from samebits import LLM, SamplingParams, trainer
from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.qwen3_moe.loader import load_state_dict, save_state_dict

N_REQUESTS, N_CHECKPOINTS = 200, 50
MAX_LEN = 48
GOOD = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=5)


def _param_mutations(vocab: int) -> list[tuple[str, object]]:
    """(field, bad value) pairs SamplingParams must refuse."""
    nan, inf = float("nan"), float("inf")
    return [
        *[("temperature", v) for v in (-1.0, inf, -inf, nan, "1", True, 1e-9, None)],
        *[("top_p", v) for v in (0.0, 1.5, -0.1, nan, inf, "x", None)],
        *[("top_k", v) for v in (0, -2, 1.5, True, "3")],
        *[("max_tokens", v) for v in (0, -1, 1.5, None, "8")],
        *[("min_tokens", v) for v in (-1, 0.5, 100)],
        *[("ignore_eos", v) for v in ("no", "", 1, 0, None, 1.0)],
        *[("seed", v) for v in (-1, 2**63, 2**70, 1.5, "3", True)],
        *[("stop_token_ids", v) for v in ([vocab], [-1], "ab", [True], 5, b"\x01", [1.0])],
    ]


def _prompt_mutations(vocab: int) -> list[tuple[str, object]]:
    """(what the message must name, bad prompt) pairs."""
    return [
        ("prompt is empty", []),
        ("prompt must be a list of int token ids", b"\x01\x02"),
        ("prompt must be a list of int token ids", bytearray(b"\x01")),
        ("prompt must be a list of int token ids", None),
        ("prompt must be a list of int token ids", 7),
        ("prompt must be a list of int token ids", [1, 2.0]),
        ("prompt must be a list of int token ids", [1, True]),
        ("prompt must be a list of int token ids", [[1, 2]]),
        ("prompt must be a list of int token ids", [1, None]),
        ("outside the vocabulary", [1, vocab]),
        ("outside the vocabulary", [-1, 2]),
        ("outside the vocabulary", [vocab + 10**6]),
        ("exceeds max_model_len", [1] * (MAX_LEN - 5)),
    ]


def _bad_request(rng: random.Random, vocab: int):
    """(prompt, params-or-None, pattern the error must match, where) for one bad request;
    params None means SamplingParams itself refused the value at construction."""
    if rng.random() < 0.6:
        field, value = rng.choice(_param_mutations(vocab))
        if field == "min_tokens" and value == 100:
            kwargs = {"min_tokens": 100, "max_tokens": 6}
        else:
            kwargs = {"max_tokens": 6, field: value}
        vocab_dependent = field == "stop_token_ids" and value in ([vocab], [-1])  # the engine's check
        if rng.random() < 0.5 and not vocab_dependent:  # refused at construction
            return [1, 2, 3], kwargs, field
        sp = SamplingParams(max_tokens=6)  # a valid object, mutated afterwards: the engine re-checks
        for k, v in kwargs.items():
            object.__setattr__(sp, k, v)
        return [1, 2, 3], sp, field
    what, prompt = rng.choice(_prompt_mutations(vocab))
    return prompt, SamplingParams(max_tokens=6), re.escape(what)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, max_num_seqs=3, max_model_len=MAX_LEN, num_blocks=12, block_size=8)


def test_random_bad_requests_are_refused_cleanly(llm):
    rng = random.Random(17)
    vocab = llm.config.vocab_size
    good_prompt = [5, 9, 11, 2]
    reference = llm.generate([good_prompt], GOOD)[0]
    total_blocks = llm.block_manager.num_free_blocks
    clear = 0
    for case in range(N_REQUESTS):
        prompt, params, pattern = _bad_request(rng, vocab)
        if isinstance(params, dict):
            with pytest.raises((ValueError, TypeError), match=pattern):
                SamplingParams(**params)
            clear += 1
            continue
        batch = [(good_prompt, GOOD)] * rng.randrange(3)  # good requests around the bad one
        at = rng.randrange(len(batch) + 1)
        batch.insert(at, (prompt, params))
        with pytest.raises((ValueError, TypeError)) as err:
            llm.generate([p for p, _ in batch], [s for _, s in batch])
        message = str(err.value)
        assert message.startswith(f"request {at}: "), (case, message)
        assert re.search(pattern, message), (case, pattern, message)
        assert llm.block_manager.num_free_blocks == total_blocks, case  # no KV block leaked
        assert not llm.scheduler.has_unfinished(), case
        clear += 1
        if case % 40 == 0:
            _assert_same(llm.generate([good_prompt], GOOD)[0], reference)
    assert clear == N_REQUESTS
    _assert_same(llm.generate([good_prompt], GOOD)[0], reference)


def test_a_changed_request_is_not_the_same(llm):
    """Negative control of the bitwise checks above: another seed gives other bits."""
    a = llm.generate([[5, 9, 11, 2]], GOOD)[0]
    b = llm.generate([[5, 9, 11, 2]], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=6))[0]
    assert a.token_ids != b.token_ids or not torch.equal(a.logprobs, b.logprobs)


def _assert_same(got, want):
    assert got.token_ids == want.token_ids
    assert torch.equal(got.logprobs, want.logprobs)


# --- checkpoints ---------------------------------------------------------------------------


def _corrupt(rng: random.Random, src, dest):
    """A broken copy of checkpoint `src` (sharded, with an index); returns a regex the error
    must match: the name of the broken file or tensor."""
    shutil.copytree(src, dest)
    shards = sorted(dest.glob("model-*.safetensors"))
    shard = rng.choice(shards)
    state = load_file(shard)
    name = rng.choice(sorted(state))
    kind = rng.choice(
        ["truncate", "zero", "header", "drop", "extra", "dtype", "shape", "nonfinite", "json", "outside"]
    )
    if kind in ("truncate", "zero", "header"):
        data = shard.read_bytes()
        cut = {"truncate": rng.randrange(1, len(data)), "zero": 0, "header": None}[kind]
        shard.write_bytes(data[:cut] if cut is not None else rng.randbytes(8) + data[8:])
        return re.escape(shard.name)
    index = dest / "model.safetensors.index.json"
    if kind == "json":
        text = index.read_text()
        index.write_text(text[: rng.randrange(len(text))])
        return re.escape(index.name)
    if kind == "outside":
        doc = json.loads(index.read_text())
        doc["weight_map"][name] = rng.choice(["../" + shard.name, str(shard), "x/" + shard.name])
        index.write_text(json.dumps(doc))
        return "outside the checkpoint directory"
    t = state.pop(name)
    if kind == "extra":
        state[name], name = t, name + "_extra"
        state[name] = t.clone()
    elif kind == "dtype":
        state[name] = t.to(rng.choice([torch.float64, torch.int8, torch.float8_e4m3fn, torch.int32]))
    elif kind == "shape":
        state[name] = torch.cat([t, t[:1]])
    elif kind == "nonfinite":
        t = t.clone()
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"), float("-inf")])
        state[name] = t
    save_file(state, str(shard), metadata={"format": "pt"})
    if kind in ("drop", "extra"):  # keep the index honest about what each shard holds
        doc = json.loads(index.read_text())
        doc["weight_map"].pop(name, None) if kind == "drop" else doc["weight_map"].__setitem__(name, shard.name)
        index.write_text(json.dumps(doc))
    return re.escape(name)


def test_random_broken_checkpoints_are_refused_by_name(tiny, tmp_path):
    rng = random.Random(23)
    cfg = json.loads((tiny / "config.json").read_text())
    src = save_state_dict(cfg, load_file(tiny / "model.safetensors"), tmp_path / "src", max_shard_bytes=40_000)
    _, reference = load_state_dict(src)
    clear = 0
    for case in range(N_CHECKPOINTS):
        dest = tmp_path / f"bad{case}"
        pattern = _corrupt(rng, src, dest)
        loaders = [load_state_dict] + ([trainer.load_hf_model] if case % 5 == 0 else [])
        for load in loaders:
            with pytest.raises(UnsupportedCheckpointError) as err:
                load(dest)
            assert re.search(pattern, str(err.value)), (case, load.__name__, pattern, str(err.value))
        clear += 1
        shutil.rmtree(dest)
    assert clear == N_CHECKPOINTS
    _, again = load_state_dict(src)  # the good checkpoint still loads to the same bits
    assert again.keys() == reference.keys()
    assert all(torch.equal(again[n], reference[n]) for n in reference)
