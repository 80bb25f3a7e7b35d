"""The command line: every bad option or path exits 2 with one line naming it, before any
work, and no traceback (issue 17: 18 of 43 bad invocations ended in a traceback)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import samebits
from samebits.cli import main

BAD_VERIFY = [
    (["--prompt-lens", "10,abc"], "--prompt-lens"),
    (["--prompt-lens", "10,,16"], "--prompt-lens"),
    (["--prompt-lens", "0"], "--prompt-lens"),
    (["--tokens", "0"], "--tokens"),
    (["--tokens", "x"], "--tokens"),
    (["--seed", "-1"], "--seed"),
    (["--model", "/no/such/dir"], "--model"),
    (["--model", "Qwen/Qwen3-0.6B"], "hf download Qwen/Qwen3-0.6B"),  # not cached: no 28 s on the network
    (["--device", "tpu"], "--device"),
    (["--json", "/missing/x.json"], "--json"),
    (["--dtype", "fp8"], "--dtype"),
]


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing ran
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(autouse=True)
def empty_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.mark.parametrize("argv,named", BAD_VERIFY)
def test_bad_verify_option_is_one_line_exit_2(argv, named, capsys):
    assert named in _refused(["verify", *argv], capsys)


def test_json_path_checked_before_the_run(tmp_path, capsys):
    """Before: `verify --json /missing/x.json` ran everything, then failed to write."""
    line = _refused(["verify", "--json", str(tmp_path / "missing" / "x.json")], capsys)
    assert "--json" in line and "does not exist" in line
    (tmp_path / "adir").mkdir()
    assert "is a directory" in _refused(["verify", "--json", str(tmp_path / "adir")], capsys)
    (tmp_path / "afile").write_text("")
    assert "--json" in _refused(["verify", "--json", str(tmp_path / "afile" / "x.json")], capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_read_only_json_folder_refused(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert "not writable" in _refused(["verify", "--json", str(ro / "x.json")], capsys)


def test_broken_checkpoint_is_one_line_exit_2(tiny, tmp_path, capsys):
    import shutil

    bad = shutil.copytree(tiny, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"")
    line = _refused(["verify", "--model", str(bad)], capsys)
    assert "model.safetensors" in line and "corrupt or truncated" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_without_cuda_refuses_before_writing_a_checkpoint(tmp_path, capsys):
    assert "no CUDA device" in _refused(["bench", "--dir", str(tmp_path / "ckpt")], capsys)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--out", "/etc/hostname/x"], "--out"),
        (["--dir", "/etc/hostname/x"], "--dir"),
        (["--layers", "0"], "--layers"),
        (["--context", "-5"], "--context"),
        (["--steps", "0"], "--steps"),
        (["--model", "/no/such/dir"], "--model"),
    ],
)
def test_bad_bench_option_is_one_line_exit_2(argv, named, tmp_path, capsys):
    assert named in _refused(["bench", "--dir", str(tmp_path / "ckpt"), *argv], capsys)
    assert not (tmp_path / "ckpt").exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"samebits {samebits.__version__}"


def test_unknown_command_and_option_are_one_line(capsys):
    assert "invalid choice" in _refused(["nope"], capsys)
    assert "--bogus" in _refused(["verify", "--bogus"], capsys)


def test_entry_point_prints_no_traceback(tmp_path):
    """The real process: exit status 2, one line on stderr."""
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub")}
    cmd = [sys.executable, "-m", "samebits.cli", "verify", "--prompt-lens", "10,abc"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "samebits verify: error: argument --prompt-lens: must be comma-separated ints >= 1 "
        "(like 10,16,24), got '10,abc'"
    ]


def test_verify_table_fits_80_columns_without_breaking_names(monkeypatch, capsys):
    from samebits.verify import ArmResult, print_table

    monkeypatch.delenv("COLUMNS", raising=False)
    names = [
        "rollout alone vs batched",
        "trainer one-at-a-time",
        "trainer packed",
        "NEG grouped_mm experts, packed",
        "NEG stock kernels, packed",
        "NEG sdpa attention, packed",
    ]
    print_table([ArmResult(n, 3, "NEG" not in n, 999, 4096, 12, 0.0116) for n in names])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    for name in names:  # each name whole on one line: not wrapped, not cut
        assert any(line.startswith(name + " ") for line in out.splitlines()), name


def test_model_option_takes_a_cached_hub_id(tiny, tmp_path):
    import shutil

    from samebits.cli import build_parser

    repo = tmp_path / "hub" / "models--tiny-org--tiny-moe"  # the HF_HUB_CACHE of the autouse fixture
    snapshot = shutil.copytree(tiny, repo / "snapshots" / "c0ffee")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    assert build_parser().parse_args(["verify", "--model", "tiny-org/tiny-moe"]).model == snapshot
