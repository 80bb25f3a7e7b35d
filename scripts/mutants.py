"""Mutation checks: swap a batch-invariant piece for a stock twin and see which tests fail.

Each mutant is a small patch to one named function in a temporary copy of `src/` and
`tests/`; the suite (or a chosen subset) then runs against the copy (`PYTHONPATH`), and a
mutant is *killed* by the tests that fail with it but pass unmutated (a baseline run on the
unmutated copy finds failures that are not the mutant's). A patch whose target function or
snippet is gone (renamed or refactored) stops the script with exit status 2: update the
target here.

    scripts/mutants.sh                       # every mutant, the batch-invariance tests
    scripts/mutants.sh --all                 # every mutant, the whole CPU suite
    scripts/mutants.sh stock-gemm -- -k wide # one mutant, extra pytest arguments
    scripts/mutants.sh --tests tests/test_kernels.py tests/test_engine.py  # other test files

Exit status: 0 every mutant killed, 1 a mutant survived, 2 a patch target not found.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBSET = [
    "tests/test_kernels.py",
    "tests/test_numerics.py",
    "tests/test_engine.py",
    "tests/test_parity.py",
    "tests/test_trainer.py",
    "tests/test_wide.py",
]


@dataclass(frozen=True)
class Mutant:
    """Replace `function` in `file` by `source` (a whole def), or, with `old`, replace the
    snippet `old` (exactly once in that function) by `source`."""

    name: str
    file: str
    function: str
    source: str
    old: str | None = None
    why: str = ""


STOCK_GEMM = '''
def matmul_ref(a, b, bias=None):
    """MUTANT: one stock GEMM over the whole M (its blocking, and a row's bits, depend on M)."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    torch.mm(a.float(), b.float(), out=out)  # out=: the stock kernel, not the override
    if bias is not None:
        out += bias.float()
    return out if a.dtype == torch.float32 else out.to(a.dtype)
'''

# The k slots summed one after another, starting at a slot the batch's size picks (as a
# kernel may pick its order by shape): a token's order, and so its bits, depend on how many
# tokens share its call. The slot sum is `sum_slots_ref` (the trainer's experts and the
# engine's slot sum in the next norm both close with it).
BATCH_ORDER_TOPK_SUM = '''
def sum_slots_ref(weighted, dtype):
    """MUTANT: the top-k slots summed in turn from slot T mod K (T: the call's tokens)."""
    k = weighted.shape[1]
    order = [(j + weighted.shape[0]) % k for j in range(k)]
    total = weighted[:, order[0]]
    for j in order[1:]:
        total = total + weighted[:, j]
    return total.to(dtype)
'''

STOCK_ATTENTION = '''
def _attend(q, k, v, q_pos, scale):
    """MUTANT: stock bmm / softmax / bmm over the batch's padded keys, out= (no override)."""
    b, r, h, d = q.shape
    kvh, length = k.shape[2], k.shape[1]
    g = h // kvh
    qf = q.float().reshape(b, r, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b * kvh, g * r, d)
    kf = k.float().permute(0, 2, 3, 1).reshape(b * kvh, d, length)
    vf = v.float().permute(0, 2, 1, 3).reshape(b * kvh, length, d)
    scores = torch.empty(b * kvh, g * r, length, device=q.device)
    torch.bmm(qf, kf, out=scores)
    scores = scores.view(b, kvh, g, r, length) * scale
    visible = torch.arange(length, device=q.device).view(1, 1, length) <= q_pos.unsqueeze(-1)
    scores = scores.masked_fill(~visible.view(b, 1, 1, r, length), float("-inf"))
    p = torch.empty_like(scores)
    torch.ops.aten._softmax.out(scores, -1, False, out=p)
    out = torch.empty(b * kvh, g * r, d, device=q.device)
    torch.bmm(p.view(b * kvh, g * r, length), vf, out=out)
    return out.view(b, kvh, g, r, d).permute(0, 3, 1, 2, 4).reshape(b, r, h, d).to(q.dtype)
'''

MUTANTS = [
    Mutant("stock-gemm", "src/samebits/kernels/matmul.py", "matmul_ref", STOCK_GEMM),
    Mutant("batch-order-topk-sum", "src/samebits/kernels/experts.py", "sum_slots_ref", BATCH_ORDER_TOPK_SUM),
    Mutant("stock-attention", "src/samebits/kernels/attention.py", "_attend", STOCK_ATTENTION),
]


class TargetNotFound(RuntimeError):
    """A mutant's function or snippet is not in the source any more."""


def apply(mutant: Mutant, root: Path) -> None:
    """Patch `root / mutant.file` in place; raise TargetNotFound naming what is missing."""
    path = root / mutant.file
    if not path.is_file():
        raise TargetNotFound(f"mutant {mutant.name}: file {mutant.file} not found")
    text = path.read_text()
    defs = [
        n
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == mutant.function
    ]
    if len(defs) != 1:
        raise TargetNotFound(
            f"mutant {mutant.name}: {len(defs)} functions named {mutant.function!r} in {mutant.file} "
            "(want exactly 1); update its target in scripts/mutants.py"
        )
    node = defs[0]
    lines = text.splitlines(keepends=True)
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
    old_def = "".join(lines[start : node.end_lineno])
    if mutant.old is None:
        indent = old_def[: len(old_def) - len(old_def.lstrip())]
        new_def = textwrap.indent(textwrap.dedent(mutant.source).strip("\n") + "\n", indent)
    else:
        if old_def.count(mutant.old) != 1:
            raise TargetNotFound(
                f"mutant {mutant.name}: the snippet {mutant.old.strip()!r} is in {mutant.function} "
                f"{old_def.count(mutant.old)} times (want 1); update it in scripts/mutants.py"
            )
        new_def = old_def.replace(mutant.old, mutant.source.lstrip("\n"))
    patched = "".join(lines[:start]) + new_def + "".join(lines[node.end_lineno :])
    compile(patched, str(path), "exec")
    path.write_text(patched)


def copy_tree(dest: Path) -> Path:
    """src/, tests/ and pyproject.toml (pytest's settings) into `dest`."""
    for part in ("src", "tests"):
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def run_suite(root: Path, tests: list[str], extra: list[str], label: str) -> tuple[set[str], int]:
    """Run pytest on the copy at `root`; return (failed test ids, tests run)."""
    report = root / f"junit-{label}.xml"
    env = os.environ | {"PYTHONPATH": str(root / "src")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu"]
    cmd += [f"--junitxml={report}", *tests, *extra]
    where = subprocess.run(
        [sys.executable, "-c", "import samebits; print(samebits.__file__)"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not where.startswith(str(root)):
        raise RuntimeError(f"the copy's samebits is not first on the path: imported {where}")
    subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not report.is_file():
        raise RuntimeError(f"{label}: pytest wrote no report (collection failed?); run {' '.join(cmd)}")
    failed, total = set(), 0
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        total += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(f"{case.get('classname')}::{case.get('name')}")
    return failed, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mutants", nargs="*", help=f"names (default all): {[m.name for m in MUTANTS]}")
    parser.add_argument("--all", action="store_true", help="run the whole CPU suite, not the subset")
    parser.add_argument("--tests", nargs="+", help="test files to run instead of the subset")
    parser.add_argument("--no-baseline", action="store_true", help="count every failure as a kill")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    chosen = [m for m in MUTANTS if not args.mutants or m.name in args.mutants]
    unknown = set(args.mutants) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}")
    tests = ["tests"] if args.all else args.tests or SUBSET
    with tempfile.TemporaryDirectory(prefix="samebits-mutants-") as tmp:
        for m in chosen:  # every target first, so a stale one fails before any suite runs
            try:
                apply(m, copy_tree(Path(tmp) / f"check-{m.name}"))
            except TargetNotFound as e:
                print(f"ERROR {e}", file=sys.stderr)
                return 2
        baseline: set[str] = set()
        if not args.no_baseline:
            baseline, total = run_suite(copy_tree(Path(tmp) / "baseline"), tests, extra, "baseline")
            print(f"baseline: {total} tests, {len(baseline)} failing unmutated (not counted as kills)")
            for name in sorted(baseline):
                print(f"  {name}")
        survived = 0
        for m in chosen:
            root = Path(tmp) / m.name
            shutil.move(Path(tmp) / f"check-{m.name}", root)
            failed, total = run_suite(root, tests, extra, m.name)
            kills = sorted(failed - baseline)
            if kills:
                print(f"mutant {m.name}: killed by {len(kills)} tests (of {total})")
                for name in kills:
                    print(f"  {name}")
            else:
                survived += 1
                print(f"mutant {m.name}: SURVIVED ({total} tests)")
            sys.stdout.flush()
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
