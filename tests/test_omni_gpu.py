"""The Qwen3-Omni thinker on CUDA: rollout vs trainer, bitwise, with the deepstack negative control.

Tiny thinker (all modalities), then a 2-layer cut of the real thinker shape with the released
encoder shapes (image, video, mixed). The 48-layer run is `benchmarks/probe_omni.py`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from omni_transformers import needs_omni_transformers

pytestmark = pytest.mark.gpu

_PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_omni.py"


def _probe():
    spec = importlib.util.spec_from_file_location("probe_omni", _PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(results):
    from samebits import verify

    bad = [(r.arm, r.mismatches, r.total) for r in results if not r.passed]
    assert not bad, bad
    assert verify.passed(results)
    assert any(not r.exact for r in results)


@needs_omni_transformers
def test_tiny_thinker_parity_cuda(tmp_path):
    from samebits.model.qwen3_omni.tiny import build_tiny_omni_checkpoint

    probe = _probe()
    path = build_tiny_omni_checkpoint(tmp_path / "tiny", seed=0)
    _check(probe.run(path, probe.tiny_prompts(), "cuda", tokens=64, seed=0, log=lambda *_: None))


@needs_omni_transformers
def test_real_shape_thinker_cut_parity_cuda(tmp_path):
    probe = _probe()
    path = probe.write_random_thinker(tmp_path / "real", layers=2, seed=0, device="cuda")
    _check(probe.run(path, probe.real_prompts(0), "cuda", tokens=64, seed=0, log=lambda *_: None))


def test_deepstack_add_gives_the_thinker_bits_without_a_host_sync_on_cuda():
    """The engine's deepstack add runs inside a step that may be queued while the one before
    runs (async scheduling): it must not wait for the device. Under CUDA's sync debug mode
    ("error": a synchronizing call raises) it gives transformers' `_deepstack_process` bits;
    control, the reason: that boolean-indexed version raises there (it counts the rows)."""
    import torch
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as om

    from samebits.numerics import ops

    g = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(37, 64, device="cuda", generator=g).bfloat16()
    mask = torch.zeros(37, dtype=torch.bool, device="cuda")
    mask[[2, 3, 9, 10, 11, 30]] = True
    emb = torch.randn(6, 64, device="cuda", generator=g).bfloat16()
    want = om.Qwen3OmniMoeThinkerTextModel._deepstack_process(None, h, mask, emb)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = ops.deepstack_add(h, mask, emb)
        with pytest.raises(RuntimeError):
            om.Qwen3OmniMoeThinkerTextModel._deepstack_process(None, h, mask, emb)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
