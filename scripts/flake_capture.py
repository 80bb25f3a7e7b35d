"""Catch a rare bitwise flake in the act: record every `LLM.generate` of a test, dump on failure.

As a pytest plugin (opt-in) it hooks every module of each `LLM`'s model and keeps, per
`generate` call, each module call's inputs and outputs (CPU clones; the tiny models only) with
the call's numerics profile and results. When a test fails, the calls of that test are saved
to `$SAMEBITS_FLAKE_DIR` (default /tmp/samebits-flake) as `<test>-<pid>.pt`:

    PYTHONPATH=$PWD/src:$PWD/scripts .venv/bin/python -m pytest -q -p flake_capture tests/...

As a script it reads such a dump and prints, for two calls of one profile (default: the first
and the last exact call), the outputs that differ and the first module call, in call order,
whose output differs, with whether its inputs were equal (equal inputs: that module itself
gave other bits):

    .venv/bin/python scripts/flake_capture.py /tmp/samebits-flake/<test>-<pid>.pt [A B]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

_CALLS: list[dict] = []  # the generate calls of the running test


def _tensors(xs) -> list[torch.Tensor]:
    xs = xs if isinstance(xs, tuple | list) else (xs,)
    return [x.detach().to("cpu", copy=True) for x in xs if isinstance(x, torch.Tensor)]


def _install() -> None:
    from samebits.engine import llm as llm_mod

    init, generate = llm_mod.LLM.__init__, llm_mod.LLM.generate

    def hooked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._flake_records = None

        def hook_for(name):
            def hook(module, inputs, output):
                if self._flake_records is not None:
                    self._flake_records.append((name, _tensors(inputs), _tensors(output)))

            return hook

        for name, module in self.runner.model.named_modules():
            module.register_forward_hook(hook_for(name))

    def recorded_generate(self, *args, **kwargs):
        self._flake_records = records = []
        try:
            outs = generate(self, *args, **kwargs)
        finally:
            self._flake_records = None
        results = [(o.token_ids, o.logprobs) for o in outs]
        _CALLS.append({"numerics": self.engine.numerics, "records": records, "results": results})
        return outs

    llm_mod.LLM.__init__ = hooked_init
    llm_mod.LLM.generate = recorded_generate


def pytest_configure(config) -> None:
    _install()


def pytest_runtest_setup(item) -> None:
    _CALLS.clear()


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" and report.failed and _CALLS:
        out = Path(os.environ.get("SAMEBITS_FLAKE_DIR", "/tmp/samebits-flake"))
        out.mkdir(parents=True, exist_ok=True)
        name = report.nodeid.split("::")[-1].replace("/", "_")
        path = out / f"{name}-{os.getpid()}.pt"
        torch.save(list(_CALLS), path)
        print(f"\nflake_capture: {len(_CALLS)} generate calls saved to {path}")


def _equal(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return len(xs) == len(ys) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(xs, ys, strict=True)
    )


def compare(path: str, a: int | None = None, b: int | None = None) -> None:
    """Print where calls a and b of the dump at `path` first differ."""
    calls = torch.load(path, weights_only=False)
    print("calls:", [(i, c["numerics"], len(c["records"])) for i, c in enumerate(calls)])
    exact = [i for i, c in enumerate(calls) if c["numerics"] == "exact"]
    a = exact[0] if a is None else a
    b = exact[-1] if b is None else b
    print(f"comparing call {a} with call {b}")
    for i, ((ta, la), (tb, lb)) in enumerate(zip(calls[a]["results"], calls[b]["results"], strict=True)):
        if ta != tb or not torch.equal(la, lb):
            where = (la != lb).nonzero().flatten().tolist() if la.shape == lb.shape else "(lengths differ)"
            print(f"  request {i}: tokens equal {ta == tb}, log-probs differ at {where}")
    for k, (ra, rb) in enumerate(zip(calls[a]["records"], calls[b]["records"], strict=False)):
        (name, ins_a, outs_a), (name_b, ins_b, outs_b) = ra, rb
        if name != name_b:
            print(f"  module call {k}: the call sequences part ({name!r} vs {name_b!r})")
            return
        if not _equal(outs_a, outs_b):
            print(f"  first differing module call {k}: {name!r}, inputs equal: {_equal(ins_a, ins_b)}")
            for x, y in zip(outs_a, outs_b, strict=False):
                if x.shape == y.shape and not torch.equal(x, y):
                    m = x != y
                    print(f"    {int(m.sum())} of {m.numel()} elements, first at {m.nonzero()[:4].tolist()}")
            return
    print("  every recorded module output is equal")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 4):
        sys.exit("usage: flake_capture.py DUMP [CALL_A CALL_B]")
    compare(sys.argv[1], *(int(x) for x in sys.argv[2:]))
