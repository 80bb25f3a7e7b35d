"""RL state is never lost and never silently changed (issue 17): each case as a user would hit it.

Checkpoints load as plain data (a crafted pickle runs nothing), are written atomically, by
default, on SIGINT/SIGTERM and after a failing reward; `--resume` refuses a changed config
unless the field is named; a run directory is never silently reused; rewards get copies;
bad options exit 2 with one line before any work.
"""

from __future__ import annotations

import json
import signal
import sys

import pytest
import torch

from samebits import rl
from samebits.cli import main
from samebits.engine.digest import tensor_digest
from samebits.rl import checkpoint, driver, loop

BITWISE = ("rollout_logprobs_mismatch_count", "old_logprobs_mismatch_count", "digest_mismatch_count")


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time_")}


def _log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _argv(tiny, out, *more: str) -> list[str]:
    return ["rl", "--model", str(tiny), "--out", str(out), "--no-live", *more]


def _reward_module(tmp_path, monkeypatch, body: str) -> str:
    (tmp_path / "state_rewards.py").write_text("from samebits.rl import toy_reward\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "state_rewards", raising=False)
    return "state_rewards:reward"


@pytest.fixture(scope="module")
def straight(tiny):
    """An uninterrupted 3-step run on the toy reward: what every interrupted run must match."""
    lp = rl.RLLoop(rl.RLConfig(model=str(tiny)))
    rows = [_untimed(lp.step()) for _ in range(3)]
    return rows, {n: tensor_digest(p) for n, p in lp.model.named_parameters()}


@pytest.fixture(scope="module")
def one_step_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("state") / "run"
    assert main(_argv(tiny, out, "--steps", "1")) == 0
    return out


# -- code in a checkpoint never runs -----------------------------------------------------------


class _RunsCode:
    """Unpickling this calls exec(...): what a crafted checkpoint.pt would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


def test_resume_refuses_a_checkpoint_that_would_run_code(tiny, tmp_path, capsys):
    marker = tmp_path / "marker"
    crafted = tmp_path / "crafted.pt"
    state = {"format": checkpoint.FORMAT, "config": {}, "step": 0, "model": {}, "rng": {}}
    torch.save(state | {"optimizer": _RunsCode(marker)}, crafted)
    assert main(_argv(tiny, tmp_path / "out", "--steps", "1", "--resume", str(crafted))) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {crafted}: refused" in err and "weights_only" in err and err.count("\n") == 1
    assert not marker.exists()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    # negative control: the same file loaded the old way (weights_only=False) does run the code
    torch.load(crafted, weights_only=False)
    assert marker.read_text() == "code ran"


def test_a_truncated_checkpoint_is_refused_with_its_name(tiny, tmp_path, one_step_run, capsys):
    cut = tmp_path / "cut.pt"
    cut.write_bytes((one_step_run / rl.CHECKPOINT).read_bytes()[:1000])
    assert main(_argv(tiny, tmp_path / "out", "--resume", str(cut))) == 2
    assert f"checkpoint {cut}: unreadable" in capsys.readouterr().err


# -- checkpoints are written by default, atomically ----------------------------------------------


def test_checkpoints_by_default_every_k_steps_and_at_the_end(tiny, tmp_path, monkeypatch):
    saved = []
    save = loop.RLLoop.save_checkpoint
    monkeypatch.setattr(
        loop.RLLoop, "save_checkpoint", lambda self, p: saved.append(self.step_count) or save(self, p)
    )
    monkeypatch.setattr(driver, "CHECKPOINT_EVERY", 2)
    rl.run(rl.RLConfig(model=str(tiny), steps=3, out_dir=str(tmp_path / "run")), live=False)
    assert saved == [2, 3]
    assert checkpoint.load(tmp_path / "run" / rl.CHECKPOINT)["step"] == 3
    assert rl.CHECKPOINT_EVERY == 10  # what `samebits rl` uses without --checkpoint-every


def test_a_failed_checkpoint_write_leaves_the_old_one_whole(tiny, tmp_path, one_step_run, monkeypatch):
    lp = rl.RLLoop(rl.RLConfig(model=str(tiny)))
    target = tmp_path / rl.CHECKPOINT
    target.write_bytes((one_step_run / rl.CHECKPOINT).read_bytes())
    before = target.read_bytes()

    def dies_midway(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        lp.save_checkpoint(target)
    assert target.read_bytes() == before and checkpoint.load(target)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [rl.CHECKPOINT]  # no temp file left


# -- SIGINT / SIGTERM and a failing reward keep the finished steps --------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_the_step_and_the_resumed_run_is_the_uninterrupted_one(
    tiny, tmp_path, monkeypatch, capsys, straight, sig
):
    body = "import os, pathlib\nMARK = pathlib.Path(__file__).with_name('signalled')\n"
    body += "def reward(p, r):\n    if not MARK.exists():\n        MARK.write_text('')\n"
    body += f"        os.kill(os.getpid(), {int(sig)})\n    return toy_reward(p, r)\n"  # once
    spec = _reward_module(tmp_path, monkeypatch, body)
    out = tmp_path / "run"
    assert main(_argv(tiny, out, "--steps", "3", "--reward", spec)) == 128 + sig
    err = capsys.readouterr().err
    assert f"stopped by {sig.name} after step 0" in err and f"--resume {out}/checkpoint.pt" in err
    assert [r["step"] for r in _log(out)] == [0]
    assert checkpoint.load(out / rl.CHECKPOINT)["step"] == 1
    resume = ["--steps", "2", "--reward", spec, "--resume", str(out / rl.CHECKPOINT)]
    assert main(_argv(tiny, out, *resume)) == 0
    rows, digests = straight
    assert [_untimed(r) for r in _log(out)] == rows
    state = checkpoint.load(out / rl.CHECKPOINT)["model"]
    assert {n: tensor_digest(state[n]) for n in digests} == digests


def test_a_failing_reward_keeps_the_finished_steps_and_resumes_with_a_named_change(
    tiny, tmp_path, monkeypatch, capsys, straight
):
    body = "calls = []\ndef reward(p, r):\n    calls.append(1)\n    if len(calls) == 3:\n"
    body += "        raise ConnectionError('grader down')\n    return toy_reward(p, r)\n"
    spec = _reward_module(tmp_path, monkeypatch, body)
    out = tmp_path / "run"
    assert main(_argv(tiny, out, "--steps", "5", "--reward", spec)) == 1
    assert "raised ConnectionError: grader down" in capsys.readouterr().err
    assert [r["step"] for r in _log(out)] == [0, 1]
    assert checkpoint.load(out / rl.CHECKPOINT)["step"] == 2  # the failed step 2 changed nothing
    resume = ["--steps", "1", "--reward", "toy", "--resume", str(out / rl.CHECKPOINT)]
    assert main(_argv(tiny, out, *resume)) == 2  # another reward: refused unless named
    assert f"reward: '{spec}' -> 'toy'" in capsys.readouterr().err
    assert main(_argv(tiny, out, *resume, "--allow-change", "reward")) == 0
    assert [_untimed(r) for r in _log(out)] == straight[0]


# -- a changed config is refused unless named ------------------------------------------------------


@pytest.mark.parametrize(
    "option,value,field,old",
    [
        ("--lr", "0.05", "lr", "0.03"),
        ("--seed", "1", "seed", "0"),
        ("--n", "2", "n", "4"),
        ("--algorithm", "grpo", "algorithm", "'gspo'"),
        ("--dtype", "float32", "dtype", "'bfloat16'"),
        ("--max-tokens", "12", "max_tokens", "24"),
    ],
)
def test_resume_refuses_a_changed_config_naming_the_field(
    tiny, one_step_run, capsys, option, value, field, old
):
    before = (one_step_run / "metrics.jsonl").read_bytes()
    argv = _argv(tiny, one_step_run, "--resume", str(one_step_run / rl.CHECKPOINT), option, value)
    assert main(argv) == 2
    err = capsys.readouterr().err
    new = repr(value) if old.startswith("'") else value
    assert f"{field}: {old} -> {new}" in err and f"--allow-change {field}" in err, err
    assert (one_step_run / "metrics.jsonl").read_bytes() == before


def test_resume_accepts_a_named_change_and_more_steps(tiny, one_step_run, tmp_path):
    out = tmp_path / "lr"
    argv = [
        "--resume",
        str(one_step_run / rl.CHECKPOINT),
        "--steps",
        "2",
        "--lr",
        "0.05",
        "--allow-change",
        "lr",
    ]
    assert main(_argv(tiny, out, *argv)) == 0
    assert [r["step"] for r in _log(out)] == [1, 2]
    assert checkpoint.load(out / rl.CHECKPOINT)["config"]["lr"] == 0.05


# -- a run directory is never silently reused --------------------------------------------------------


def test_an_existing_run_directory_is_refused_unless_resumed_or_overwritten(
    tiny, one_step_run, tmp_path, capsys
):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("metrics.jsonl", rl.CHECKPOINT):
        (out / name).write_bytes((one_step_run / name).read_bytes())
    before = (out / "metrics.jsonl").read_bytes()
    assert main(_argv(tiny, out, "--steps", "1")) == 2
    err = capsys.readouterr().err
    assert (
        "already holds a run (metrics.jsonl, checkpoint.pt)" in err
        and "--resume" in err
        and "--overwrite" in err
    )
    assert (out / "metrics.jsonl").read_bytes() == before
    assert main(_argv(tiny, out, "--steps", "1", "--overwrite")) == 0
    assert [r["step"] for r in _log(out)] == [0]


# -- rewards get copies ------------------------------------------------------------------------------


EDITS = "def reward(p, r):\n    values = toy_reward(p, r)\n    for x in r:\n"
EDITS += "        x[:] = [8] * len(x)\n    return values\n"


def test_a_reward_that_edits_its_token_lists_does_not_change_what_is_trained(
    tiny, tmp_path, monkeypatch, straight
):
    spec = _reward_module(tmp_path, monkeypatch, EDITS)
    row = rl.RLLoop(rl.RLConfig(model=str(tiny), reward=spec)).step()
    assert _untimed(row) == straight[0][0]


def test_negative_control_without_copies_the_edit_reaches_the_trainer(tiny, tmp_path, monkeypatch):
    spec = _reward_module(tmp_path, monkeypatch, EDITS)
    monkeypatch.setattr(loop, "compute_rewards", lambda name, fn, p, r: [float(v) for v in fn(p, r)])
    row = rl.RLLoop(rl.RLConfig(model=str(tiny), reward=spec)).step()
    assert row["rollout_logprobs_mismatch_count"] > 0


# -- bad options: exit 2, one line, before any work -----------------------------------------------------


@pytest.mark.parametrize(
    "options,says",
    [
        (["--checkpoint-every", "-1"], "--checkpoint-every must be an int >= 0"),
        (["--allow-change", "lr,learning_rate"], "--allow-change: unknown config field(s) ['learning_rate']"),
        (["--resume", "/nonexistent/checkpoint.pt"], "checkpoint /nonexistent/checkpoint.pt: no such file"),
        (["--resume", "x.pt", "--overwrite"], "--overwrite and --resume together"),
        (["--out", "FILE"], "exists and is not a directory"),
        (["--steps", "0"], "steps must be an int >= 1, got 0"),
        (["--temperature", "nan"], "temperature must be a finite number > 0"),
        (["--seed", str(2**31)], "seed must be an int in [0, 2**30)"),  # (seed << 32) would pass 2**63
    ],
)
def test_bad_rl_options_exit_2_with_one_line_before_any_work(
    tiny, tmp_path, monkeypatch, capsys, options, says
):
    monkeypatch.setattr(driver, "RLLoop", None)  # building the loop would be work: it must not happen
    (tmp_path / "FILE").write_text("")
    options = [str(tmp_path / o) if o == "FILE" else o for o in options]
    argv = ["rl", "--model", str(tiny), "--no-live", "--out", str(tmp_path / "out"), *options]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("samebits rl: ") and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "out").exists()


def test_checkpoint_every_in_the_api_is_checked_too(tiny):
    with pytest.raises(ValueError, match="--checkpoint-every must be an int >= 0"):
        rl.check_options(rl.RLConfig(model=str(tiny)), checkpoint_every=-1)
