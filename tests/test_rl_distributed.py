"""`samebits rl --distributed`: 2 gloo ranks under torchrun (FSDP2 trainer, a replica per rank).

Each run is a real `torchrun --nproc-per-node 2` subprocess on 127.0.0.1 and a free port
(no network); it reads back the combined metrics.jsonl, whose rank_* fields carry every
rank's own counters and digests.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from samebits.rl.distributed import combine, passed
from samebits.rl.distributed import digest_of as _digest_of

TIMEOUT_S = 300  # a hung collective fails the test instead of hanging CI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1", "SAMEBITS_CACHE": str(tmp_path / "cache")}
    if sys.platform == "linux":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _cli(tmp_path, tiny, name: str, *options: str) -> tuple[int, list[dict]]:
    out = tmp_path / name
    args = ["-m", "samebits.cli", "rl", "--distributed", "--model", str(tiny), "--out", str(out), "--no-live"]
    proc = _torchrun([*args, *options], tmp_path)
    metrics = out / "metrics.jsonl"
    assert metrics.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, [json.loads(line) for line in metrics.read_text().splitlines()]


def _initial_digest(tiny) -> str:
    from samebits import LLM

    llm = LLM(str(tiny), device="cpu", dtype="bfloat16", max_num_seqs=1, max_model_len=16)
    digests = llm.weight_digests(kind="fast")  # the kind `samebits rl` digests by default
    return _digest_of(digests, list(digests))


def test_two_ranks_three_steps_bitwise_on_every_rank_and_every_replica_holds_the_trainer_bits(tmp_path, tiny):
    # 48-token micro-batches: the ranks pack different counts, so the padding path runs too
    rc, rows = _cli(tmp_path, tiny, "ok", "--steps", "3", "--micro-batch-tokens", "48")
    assert rc == 0
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["world_size"] == 2
        assert r["rank_rollout_logprobs_mismatch_count"] == [0, 0], r
        assert r["rank_old_logprobs_mismatch_count"] == [0, 0], r
        assert r["rank_digest_mismatch_count"] == [0, 0], r
        assert all(n > 0 for n in r["rank_rollout_logprobs_tokens"] + r["rank_old_logprobs_tokens"]), r
        assert r["digests_checked"] == 36  # every tiny parameter
        digests = r["rank_replica_digest"] + r["rank_trainer_digest"]
        assert r["digests_agree"] and len(set(digests)) == 1, r
    assert sum(sum(r["rank_padding_micro_batches"]) for r in rows) > 0
    # the digests can tell weights apart: each sync moved them away from the checkpoint's
    after = [r["rank_replica_digest"][0] for r in rows]
    assert len({_initial_digest(tiny), *after}) == 4


def test_negative_control_grouped_mm_trainer_mismatches_on_every_rank(tmp_path, tiny):
    rc, rows = _cli(tmp_path, tiny, "grouped_mm", "--steps", "1", "--trainer-experts", "grouped_mm")
    assert rc == 1
    (r,) = rows
    assert all(m > 0 for m in r["rank_rollout_logprobs_mismatch_count"]), r
    assert r["rank_old_logprobs_mismatch_count"] == [0, 0]  # recompute and update: both grouped_mm
    assert r["digests_agree"]


DIGEST_CONTROL = textwrap.dedent(
    """
    import json, os, sys, torch
    import torch.distributed as dist
    from samebits.rl.config import RLConfig
    from samebits.rl.distributed import DistributedRLLoop

    loop = DistributedRLLoop(RLConfig(model=sys.argv[1], steps=1))
    clean = loop.sync_and_check(push=False)
    if loop.rank == 1:  # one replica drifts: the lowest bit of one bf16 element of one tensor
        name = "model.layers.0.self_attn.q_proj.weight"
        t = dict(loop.llm.model.named_parameters())[name].detach().clone()
        t.view(torch.int16).view(-1)[0] ^= 1
        loop.llm.update_weights([(name, t)])
    drifted = loop.sync_and_check(push=False)
    healed = loop.sync_and_check(push=True)  # a sync puts the trainer's bits back
    out = [None, None]
    dist.all_gather_object(out, [clean["bad"], drifted["bad"], healed["bad"], drifted["replica"]])
    if loop.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # skip interpreter teardown: once in CI a rank aborted there ("terminate called without an
    # active exception", exit -6) after all the work was done and checked
    sys.stdout.flush()
    os._exit(0)
    """
)


def test_negative_control_a_drifted_replica_is_caught_on_its_rank_only(tmp_path, tiny):
    script = tmp_path / "digest_control.py"
    script.write_text(DIGEST_CONTROL)
    proc = _torchrun([str(script), str(tiny)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    (clean0, drifted0, healed0, replica0), (clean1, drifted1, healed1, replica1) = json.loads(line[7:])
    assert clean0 == clean1 == drifted0 == healed0 == healed1 == []
    assert drifted1 == ["model.layers.0.self_attn.q_proj.weight"]
    assert replica0 != replica1


# -- combining the ranks' counters (no processes) ---------------------------------------------


def _local(mism: int, digest: str = "d") -> dict:
    return {
        "rollout_logprobs_mismatch_count": mism,
        "rollout_logprobs_tokens": 10,
        "old_logprobs_mismatch_count": 0,
        "old_logprobs_tokens": 5,
        "digest_mismatch_count": 0,
        "padding_micro_batches": 0,
        "diff_max": 0.5 * mism,
        "replica_digest": digest,
        "trainer_digest": "d",
        "rewards": [0.0, 1.0],
        "advantage_abs_max": 0.7,
        "lengths": [3, 4],
        "loss": 0.0,
        "clip_frac": 0.0,
        "grad_norm": 1.0,
        "times": {"step": 1.0},
    }


def test_combine_sums_per_rank_counters_and_passed_needs_every_rank_and_equal_digests():
    ok = combine(0, [_local(0), _local(0)], 36)
    assert passed([ok]) and ok["rollout_logprobs_tokens"] == 20
    one_bad = combine(0, [_local(0), _local(3)], 36)
    assert one_bad["rank_rollout_logprobs_mismatch_count"] == [0, 3]
    assert one_bad["rollout_logprobs_mismatch_count"] == 3 and not passed([one_bad])
    disagree = combine(0, [_local(0), _local(0, digest="e")], 36)
    assert not disagree["digests_agree"] and not passed([disagree])
    with pytest.raises(KeyError):
        combine(0, [{}], 36)
