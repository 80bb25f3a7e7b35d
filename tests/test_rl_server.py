"""`samebits rl --server`: the trainer in this process, the engine a `samebits serve` it reaches
only over HTTP and the weight-update group, as an external framework would."""

from __future__ import annotations

import pytest

from samebits import rl
from samebits.rl.remote import RemoteEngine

SMALL = dict(steps=2, num_prompts=2, n=2, max_tokens=10, mini_batches=2)
BITWISE = ("rollout_logprobs_mismatch_count", "old_logprobs_mismatch_count", "digest_mismatch_count")


@pytest.mark.parametrize("sync", ["distributed", "tensor"])
def test_every_step_is_bitwise_through_the_server(tiny, sync):
    rows = rl.run(rl.RLConfig(model=str(tiny), server="spawn", weight_sync=sync, **SMALL), live=False)
    for r in rows:
        assert all(r[k] == 0 for k in BITWISE), r
        assert r["rollout_logprobs_tokens"] > 0 and r["old_logprobs_tokens"] > 0 and r["digests_checked"] == 36


def test_control_a_push_that_never_reaches_the_server_mismatches(tiny, monkeypatch):
    """The claim's reason is the sync: with the pushes dropped, step 1 samples from the old
    weights, and both the digests and the rollout log-probs catch it."""
    monkeypatch.setattr(RemoteEngine, "update_weights", lambda self, named: None)
    rows = rl.run(rl.RLConfig(model=str(tiny), server="spawn", **SMALL), live=False)
    assert rows[0]["rollout_logprobs_mismatch_count"] == 0  # before any update both sides agree
    assert rows[0]["digest_mismatch_count"] > 0  # the first update never arrived
    assert rows[1]["rollout_logprobs_mismatch_count"] > 0
    assert not rl.passed(rows)


def test_server_settings_are_checked_at_construction(tiny):
    with pytest.raises(ValueError, match="server must be 'spawn' or an http"):
        rl.RLConfig(model=str(tiny), server="localhost:8000")
    with pytest.raises(ValueError, match="share_weights"):
        rl.RLConfig(model=str(tiny), server="spawn", share_weights=True)
    with pytest.raises(ValueError, match="NCCL cannot put two ranks on one GPU"):
        rl.RLConfig(model=str(tiny), server="spawn", device="cuda")
    with pytest.raises(ValueError, match="weight_sync"):
        rl.RLConfig(model=str(tiny), server="spawn", weight_sync="nccl")


@pytest.mark.gpu
def test_cuda_loop_through_a_server_on_the_same_gpu_by_ipc(tiny):
    cfg = rl.RLConfig(model=str(tiny), device="cuda", server="spawn", weight_sync="tensor", **SMALL)
    for r in rl.run(cfg, live=False):
        assert all(r[k] == 0 for k in BITWISE), r


def test_a_running_server_by_url(tiny):
    """`--server URL`: the loop joins a server someone else started (as a framework would),
    and leaves it running."""
    from serve_server import Server

    server = Server(tiny, "--max-num-seqs", "4", "--max-model-len", "64")
    try:
        rows = rl.run(rl.RLConfig(model=str(tiny), server=server.url, **SMALL), live=False)
        assert all(r[k] == 0 for r in rows for k in BITWISE)
        assert server.proc.poll() is None  # still serving after the run
    finally:
        server.stop()
