"""`samebits bench` results: one table (rich), bench.json, bench.csv and bench.png."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from samebits.plotting import pyplot

STOCK_TRAINER = "stock transformers (grouped_mm + sdpa)"
EXACT_TRAINER = "samebits kernels (exact)"
COLUMNS = ("exact", "fast", "transformers")  # the table's arms, in order


@dataclass
class Row:
    """One decode point of one arm: `batch` sequences holding `context` tokens of KV.

    `step_ms`: the engine step (`ModelRunner.run`) for the exact/fast arms, generate's extra
    time per token for transformers. `generate_ms`: ms per output token through
    `LLM.generate` (the median step in which all B rows decode; None when not measured);
    `replay_ms`: the CUDA-graph replay alone;
    `prefill_tok_s`: prompt tokens/s of `batch` prompts of `context` tokens through generate.
    `floor_ms`: the step's bytes over the copy bandwidth measured in the run;
    `nominal_floor_ms`: the same bytes over the card's nominal bandwidth (the decode floor of
    docs/speed-measurements.md; None on a card not listed); `prefill_floor_tok_s`: the
    prefill's FLOPs per token at 790 TFLOP/s.
    """

    arm: str
    batch: int
    context: int
    step_ms: float
    tokens_per_s: float
    floor_ms: float
    generate_ms: float | None = None
    replay_ms: float | None = None
    prefill_tok_s: float | None = None
    nominal_floor_ms: float | None = None
    prefill_floor_tok_s: float | None = None
    generate_difference_ms: float | None = None  # (t_last - t_first) / (last - first) of generate calls

    @property
    def generate_over_floor(self) -> float | None:
        """Decode through generate over its nominal floor (1.0: at the floor)."""
        if self.generate_ms is None or self.nominal_floor_ms is None:
            return None
        return self.generate_ms / self.nominal_floor_ms

    @property
    def prefill_over_floor(self) -> float | None:
        """Prefill time over its FLOP floor (1.0: at the floor): floor tok/s over measured."""
        if not self.prefill_tok_s or self.prefill_floor_tok_s is None:
            return None
        return self.prefill_floor_tok_s / self.prefill_tok_s

    @property
    def floor_fraction(self) -> float:
        """The memory floor over the step time (1.0: every step reads only what it must)."""
        return self.floor_ms / self.step_ms

    def as_dict(self) -> dict:
        generate_tok_s = None if self.generate_ms is None else 1000 * self.batch / self.generate_ms
        return asdict(self) | {
            "floor_fraction": self.floor_fraction,
            "generate_tokens_per_s": generate_tok_s,
            "generate_over_floor": self.generate_over_floor,
            "prefill_over_floor": self.prefill_over_floor,
        }


@dataclass
class BenchResult:
    """Everything one `samebits bench` run measured. `rollout`: per arm, `RolloutTimes` as a
    dict plus its output tok/s; `rl_step`: `samebits.rl.arms.bench_ratio` (None without --rl)."""

    rows: list[Row] = field(default_factory=list)
    trainer_ms: dict[str, float] = field(default_factory=dict)
    rollout: dict[str, dict] = field(default_factory=dict)
    rl_step: dict | None = None
    meta: dict = field(default_factory=dict)


def table_rows(result: BenchResult) -> list[tuple[str, str, list[float | None], str]]:
    """(measure, batch, value per arm in COLUMNS, unit) rows of the table, in print order."""
    by = {(r.arm, r.batch): r for r in result.rows}
    out = []
    for b in sorted({r.batch for r in result.rows}):

        def pick(attr, arms=COLUMNS, b=b):
            return [getattr(by[(a, b)], attr) if (a, b) in by and a in arms else None for a in COLUMNS]

        generate = pick("generate_ms")
        out += [
            ("decode through generate", str(b), generate, "ms/token"),
            (
                "decode through generate",
                str(b),
                [None if v is None else 1000 * b / v for v in generate],
                "tok/s",
            ),
            ("engine step (runner)", str(b), pick("step_ms", ("exact", "fast")), "ms"),
            ("CUDA-graph replay", str(b), pick("replay_ms"), "ms"),
            ("memory floor", str(b), pick("floor_ms"), "ms"),
            ("decode floor (nominal bandwidth)", str(b), pick("nominal_floor_ms"), "ms"),
            ("decode through generate / floor", str(b), pick("generate_over_floor"), "x"),
            ("prefill through generate", str(b), pick("prefill_tok_s"), "tok/s"),
            ("prefill floor (790 TFLOP/s)", str(b), pick("prefill_floor_tok_s"), "tok/s"),
            ("prefill time / floor", str(b), pick("prefill_over_floor"), "x"),
        ]
    if result.rollout:
        r = next(iter(result.rollout.values()))  # every arm runs the same shape
        shape = f"{r['requests']} x ({r['prompt_len']} -> {r['new_tokens']})"
        vals = [result.rollout[a]["output_tok_s"] if a in result.rollout else None for a in COLUMNS]
        out.append(("rollout through generate", shape, vals, "output tok/s"))
    if result.trainer_ms:
        vals = [result.trainer_ms.get(EXACT_TRAINER), result.trainer_ms.get(STOCK_TRAINER), None]
        out.append(("trainer fwd+bwd 4 x 1024 (fast: stock)", "", vals, "ms"))
    if result.rl_step:
        vals = [result.rl_step["on_policy_s"], result.rl_step["stock_s"], None]
        out.append(("RL step (exact: on-policy, fast: stock)", result.rl_step["shape"], vals, "s"))
    return out


def exact_over_fast(vals: list[float | None], unit: str) -> str:
    """exact's time over fast's (for rates: fast's rate over exact's); 1.00x: exactness is free."""
    exact, fast = vals[0], vals[1]
    if exact is None or fast is None:
        return ""
    return f"{(fast / exact if 'tok/s' in unit else exact / fast):.2f}x"


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if "tok/s" in unit else f"{v:.2f}"


def print_table(result: BenchResult, console=None) -> None:
    """One table: a row per measure and batch, a column per arm, and exact's cost over fast."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"samebits bench ({result.meta.get('device', '?')})")
    for c in ("measure", "batch", "unit", *COLUMNS, "exact / fast time"):
        t.add_column(c, justify="left" if c in ("measure", "unit") else "right")
    last_batch = None
    for measure, batch, vals, unit in table_rows(result):
        if last_batch is not None and batch != last_batch:
            t.add_section()
        last_batch = batch
        ratio = "" if "floor" in measure else exact_over_fast(vals, unit)  # the same bytes and FLOPs
        t.add_row(measure, batch, unit, *[_fmt(v, unit) for v in vals], ratio)
    (console or Console(width=160)).print(t)


def write_outputs(result: BenchResult, out: Path, plot: bool = True) -> list[Path]:
    """bench.json (everything), bench.csv (one line per decode point), bench.png (tok/s by
    batch, when matplotlib is installed and `plot`). Each file is written whole to a temporary
    name and then renamed, so a run stopped while writing leaves the previous version. Returns
    the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    decode = [r.as_dict() for r in result.rows]
    data = {
        "meta": result.meta,
        "decode": decode,
        "rollout": result.rollout,
        "trainer_ms": result.trainer_ms,
        "rl_step": result.rl_step,
    }
    written = [out / "bench.json", out / "bench.csv"]
    _replace(written[0], json.dumps(data, indent=2))
    fields = list(Row.__dataclass_fields__) + [
        "floor_fraction",
        "generate_tokens_per_s",
        "generate_over_floor",
        "prefill_over_floor",
    ]
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=fields)
    w.writeheader()
    w.writerows(decode)
    _replace(written[1], text.getvalue())
    if plot and _plot(result.rows, out / "bench.png"):
        written.append(out / "bench.png")
    return written


class RowLog:
    """A benchmark's measured rows, rewritten as JSON ({**meta, "rows": [...]}) to `path` after
    each one (atomically), so a run stopped part way keeps what it measured; no file where
    `path` is None."""

    def __init__(self, path: str | Path | None, **meta):
        self.path = Path(path) if path else None
        self.meta = meta
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if self.path is not None:
            _replace(self.path, json.dumps({**self.meta, "rows": self.rows}, indent=1))


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        f.write(text)
    tmp.replace(path)


def _plot(rows: list[Row], path: Path) -> bool:
    plt = pyplot(str(path))
    if plt is None or not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in dict.fromkeys(r.arm for r in rows):
        pts = [r for r in rows if r.arm == arm]
        ax.plot([r.batch for r in pts], [r.tokens_per_s for r in pts], marker="o", label=f"{arm} step")
        gen = [r for r in pts if r.generate_ms is not None and r.arm != "transformers"]
        if gen:
            ax.plot(
                [r.batch for r in gen],
                [1000 * r.batch / r.generate_ms for r in gen],
                "--",
                label=f"{arm} generate",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"decode at {rows[0].context} tokens of context")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
