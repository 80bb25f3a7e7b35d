"""`samebits verify`: the probe matrix passes, and its verdict can fail."""

from __future__ import annotations

import json

from samebits import verify
from samebits.cli import main


def test_verify_cli_passes_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.setenv("SAMEBITS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "v.json"
    assert main(["verify", "--tokens", "12", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["passed"] is True
    exact = [a for a in doc["arms"] if a["exact"]]
    neg = [a for a in doc["arms"] if not a["exact"]]
    assert len(exact) == 9 and all(a["mismatches"] == 0 and a["total"] == 12 for a in exact)
    assert {a["arm"] for a in neg} == {
        "NEG grouped_mm experts, packed",
        "NEG sdpa attention, packed",
    }
    assert all(a["mismatches"] > 0 for a in neg)


def test_verify_fp32_uses_the_stock_kernel_control(tmp_path, monkeypatch):
    monkeypatch.setenv("SAMEBITS_CACHE", str(tmp_path / "cache"))
    results = verify.run(dtype="float32", tokens=8, log=lambda *_: None)
    assert verify.passed(results)
    assert any(r.arm.startswith("NEG stock kernels") and r.mismatches > 0 for r in results)


def test_verdict_fails_on_an_exact_mismatch_or_a_silent_negative_control():
    ok = verify.ArmResult("trainer packed", 0, True, 0, 10, None, 0.0)
    bad = verify.ArmResult("trainer packed", 1, True, 1, 10, 3, 0.01)
    neg = verify.ArmResult("NEG x", 0, False, 4, 10, 0, 0.02)
    silent = verify.ArmResult("NEG y", 0, False, 0, 10, None, 0.0)
    assert verify.passed([ok, neg])
    assert not verify.passed([ok, bad, neg])
    assert not verify.passed([ok, neg, silent])


def test_compare_counts_bits():
    import torch

    a = torch.tensor([0.5, -1.0, 2.0])
    r = verify.compare("x", 0, True, a, a.clone())
    assert r.mismatches == 0 and r.first_mismatch is None
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(0.0))  # one ulp
    r = verify.compare("x", 0, True, b, a)
    assert r.mismatches == 1 and r.first_mismatch == 1 and r.max_abs_diff > 0


def test_verify_on_a_framework_line_checks_it_and_its_neighbour_control_differs(tmp_path, monkeypatch):
    monkeypatch.setenv("SAMEBITS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "v.json"
    args = ["--tokens", "10", "--temperature", "0.7", "--logprob-formula", "verl", "--json", str(out)]
    assert main(["verify", *args]) == 0
    arms = json.loads(out.read_text())["arms"]
    exact = [a for a in arms if a["exact"]]
    names = {"rollout alone vs batched", "trainer one-at-a-time, verl", "trainer packed, verl"}
    assert {a["arm"] for a in exact} == names
    assert all(a["mismatches"] == 0 for a in exact)
    assert {a["arm"] for a in arms if not a["exact"]} == {"NEG log_softmax line, packed"}
    assert sum(a["mismatches"] for a in arms if not a["exact"]) > 0


def test_verify_refuses_an_unknown_formula_before_any_rollout():
    import pytest

    with pytest.raises(ValueError, match="logprob_formula must be"):
        verify.run(logprob_formula="softmax", log=lambda *_: None)
