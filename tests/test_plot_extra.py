"""matplotlib is the optional `samebits[plot]` extra: without it the PNG is skipped with a
message saying how to install it; with it the PNG is written."""

from __future__ import annotations

import sys

from samebits.rl import report

ROWS = [
    {
        "step": s,
        "reward_mean": 0.5,
        "reward_std": 0.1,
        "rollout_logprobs_mismatch_count": 0,
        "old_logprobs_mismatch_count": 0,
        "digest_mismatch_count": 0,
    }
    for s in (1, 2)
]


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.pyplot", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` now raises ImportError
    out = tmp_path / "metrics.png"
    assert report.plot(ROWS, out) is None
    assert not out.exists()
    err = capsys.readouterr().err
    assert f"{out} not written: matplotlib is not installed" in err
    assert "pip install 'samebits[plot]'" in err


def test_plot_with_matplotlib_writes_the_png(tmp_path, capsys):
    """The control: the same call with matplotlib importable writes the PNG and says nothing."""
    out = tmp_path / "metrics.png"
    assert report.plot(ROWS, out) == out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "not installed" not in capsys.readouterr().err
