"""What a run shows: a live rich table on stderr, metrics.jsonl, and a PNG at the end."""

from __future__ import annotations

import json
from pathlib import Path

from samebits.plotting import pyplot

COLUMNS = (  # (metric, header, format); every metric is in metrics.jsonl
    ("step", "step", "{}"),
    ("rollout_logprobs_mismatch_count", "rollout\nmism", "{}"),
    ("old_logprobs_mismatch_count", "old\nmism", "{}"),
    ("rollout_logprobs_tokens", "tokens", "{}"),
    ("diff_max", "diff\nmax", "{:.3g}"),
    ("digest_mismatch_count", "digest\ndiffs", "{}"),
    ("reward_mean", "reward\nmean", "{:.3f}"),
    ("reward_std", "reward\nstd", "{:.3f}"),
    ("response_len_mean", "len\nmean", "{:.1f}"),
    ("grad_norm", "grad\nnorm", "{:.3g}"),
    ("time_rollout_s", "rollout\ns", "{:.2f}"),
    ("time_recompute_s", "recomp\ns", "{:.2f}"),
    ("time_update_s", "update\ns", "{:.2f}"),
    ("time_step_s", "step\ns", "{:.2f}"),
)


def table(rows: list[dict], title: str = "samebits rl"):
    from rich.table import Table

    t = Table(title=title)
    for _, header, _ in COLUMNS:
        t.add_column(header, justify="right")
    for r in rows:
        bad = any(r[k] for k in ("rollout_logprobs_mismatch_count", "old_logprobs_mismatch_count"))
        bad = bad or r["digest_mismatch_count"]
        t.add_row(*(fmt.format(r[key]) for key, _, fmt in COLUMNS), style="red" if bad else None)
    return t


class LiveTable:
    """A rich Live table on stderr, redrawn after every step."""

    def __init__(self, title: str):
        from rich.console import Console
        from rich.live import Live

        self.title = title
        self.rows: list[dict] = []
        self._live = Live(table([], title), console=Console(stderr=True), auto_refresh=False)
        self._live.start()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self._live.update(table(self.rows, self.title), refresh=True)

    def close(self) -> None:
        self._live.stop()


def print_table(rows: list[dict], title: str) -> None:
    """The final table on stdout, wide enough for every column even when piped."""
    from rich.console import Console

    console = Console()
    Console(width=max(console.width, 132)).print(table(rows, title))


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot(rows: list[dict], path: Path) -> Path | None:
    """Reward mean (± std) and both mismatch counts over steps, as a PNG (Agg backend).

    None, with a message on stderr, when matplotlib (the `samebits[plot]` extra) is missing."""
    plt = pyplot(str(path))
    if plt is None:
        return None
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    mean = [r["reward_mean"] for r in rows]
    std = [r["reward_std"] for r in rows]
    top.plot(steps, mean, marker="o", label="reward mean")
    low = [m - s for m, s in zip(mean, std, strict=True)]
    high = [m + s for m, s in zip(mean, std, strict=True)]
    top.fill_between(steps, low, high, alpha=0.2)
    top.set_ylabel("reward")
    top.legend()
    for key, label in (
        ("rollout_logprobs_mismatch_count", "rollout vs recompute"),
        ("old_logprobs_mismatch_count", "update forward vs recompute"),
        ("digest_mismatch_count", "weight digests differing"),
    ):
        bottom.plot(steps, [r[key] for r in rows], marker="o", label=label)
    bottom.set_ylabel("mismatching tokens / tensors")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.legend()
    fig.suptitle("samebits rl: reward and bitwise mismatch counts")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
