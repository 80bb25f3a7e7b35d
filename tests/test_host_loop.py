"""The host loop's batch-level pieces give what the per-row code gave: the sampling keys
and temperatures of a batch (numpy, whole batch) equal the per-row Python formula bit for
bit, and a step's `StepOutput` names each request once and counts every finished sample
once, whether the scheduler finished it (length) or a stop string in its text did."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.engine import core as core_module
from samebits.engine.sampler import _MASK64, SampleRequest, _row_keys, row_inputs, row_keys
from samebits.model.tiny_tokenizer import add_tiny_tokenizer


def _seeds_and_indices() -> tuple[list[int], list[int]]:
    rng = random.Random(7)
    seeds = [0, 1, 2**63 - 1, 2**62, 2**32 - 1, 2**32] + [rng.randrange(2**63) for _ in range(500)]
    indices = [0, 1, 2**20, 2**31 - 1, 2**32 + 5, 7] + [rng.randrange(1 << 17) for _ in range(500)]
    return seeds, indices


def _python_keys(seeds: list[int], indices: list[int]) -> torch.Tensor:
    return torch.tensor([_row_keys(s, i) for s, i in zip(seeds, indices, strict=True)], dtype=torch.int64)


def test_row_keys_of_a_batch_equal_the_per_row_python_keys():
    seeds, indices = _seeds_and_indices()
    assert torch.equal(row_keys(seeds, indices), _python_keys(seeds, indices))


def test_control_keys_without_the_63_bit_mask_differ():
    # the claim's reason: uint64 wraps modulo 2**64 and the mask then keeps Python's 63 bits;
    # without the mask bit 63 leaks into the high key
    seeds, indices = _seeds_and_indices()
    s, i = np.array(seeds, dtype=np.uint64), np.array(indices, dtype=np.uint64)
    mixed = s * np.uint64(0x9E3779B97F4A7C15) + i * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(1)
    mixed ^= mixed >> np.uint64(31)
    unmasked = np.stack([mixed & np.uint64(0xFFFFFFFF), mixed >> np.uint64(32)], axis=1).astype(np.int64)
    assert _MASK64 == 2**63 - 1
    assert not torch.equal(torch.from_numpy(unmasked), _python_keys(seeds, indices))


def test_row_inputs_equal_the_per_row_formula():
    temps = [0, 0.0, 1, 1.0, 0.7, 1 / 3, 2.5, 1e-3, 0.123456789123]
    reqs = [SampleRequest(SamplingParams(temperature=t), 1000 + k, k) for k, t in enumerate(temps)]
    got_temps, got_keys, got_random = row_inputs(reqs)
    want_temps = torch.tensor([t if t > 0 else 1.0 for t in temps]).float()  # the per-row formula
    assert got_temps.dtype == torch.float32 and torch.equal(got_temps, want_temps)
    assert torch.equal(got_random, torch.tensor([t > 0 for t in temps]))
    assert torch.equal(got_keys, _python_keys([r.seed for r in reqs], [r.output_index for r in reqs]))


@pytest.fixture(scope="module")
def llm(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tiny"
    shutil.copytree(tiny, path)
    return LLM(add_tiny_tokenizer(path), max_num_seqs=4, max_model_len=128)


def _drive(llm) -> tuple[int, int, list[list[str]], str]:
    """Requests with text, a stop string, top log-probs and n=2, stepped to the end ->
    (samples, finishes the steps counted, each step's request ids, the stop request's reason)."""
    base = llm.generate([[5, 6]], SamplingParams(max_tokens=40, ignore_eos=True, seed=3))[0]
    core, steps, counted = llm.core, [], 0
    kinds = [
        SamplingParams(max_tokens=40, ignore_eos=True, seed=3, stop=[base.text[10:12]]),
        SamplingParams(max_tokens=9, ignore_eos=True, seed=4, logprobs=2, n=2),
        SamplingParams(max_tokens=13, ignore_eos=True, seed=5, detokenize=False),
    ]
    with core.lock:
        ids = [core.add_request(f"r{k}", [5, 6], sp) for k, sp in enumerate(kinds)]
        while core.has_unfinished():
            out = core.step()
            steps.append(out.request_ids)
            counted += out.num_finished
        outs = [core.pop(r) for r in ids]
    return sum(len(o.outputs) for o in outs), counted, steps, outs[0].finish_reason


def test_each_step_names_its_requests_once_and_counts_every_finish_once(llm):
    samples, counted, steps, stop_reason = _drive(llm)
    assert stop_reason == "stop"  # the stop string finished it, not the scheduler
    assert counted == samples == 4
    assert all(len(ids) == len(set(ids)) and set(ids) <= {"r0", "r1", "r2"} for ids in steps)
    assert {"r0", "r1", "r2"} <= {r for ids in steps for r in ids}


def test_control_finishes_by_stop_string_are_counted_by_the_watched_rows_only(llm, monkeypatch):
    # the count's reason: a stop string finishes a sample outside the scheduler's postprocess
    advance = core_module.EngineCore._advance_watched
    monkeypatch.setattr(core_module.EngineCore, "_advance_watched", lambda self, c, b: advance(self, c, b) * 0)
    samples, counted, _, stop_reason = _drive(llm)
    assert stop_reason == "stop" and counted == samples - 1
