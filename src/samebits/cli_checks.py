"""Command-line refusals: every bad option or path exits 2 with one line naming it,
before any work (no usage block, no traceback).

Option values are checked by argparse `type=` functions, so a bad value is refused
while parsing; output paths are checked writable then, not after an hour of work.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from samebits.requests import SamplingParams

USAGE_ERROR = 2  # the exit status of every refusal (argparse's own convention)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def refuse(prog: str, message: str):
    """One line on stderr, exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def _checked(text: str, parse, ok, want: str):
    """`parse(text)` when it parses and passes `ok`, else an argparse error saying `want`."""
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1."""
    return _checked(text, int, lambda v: v >= 1, "an int >= 1")


def non_negative_int(text: str) -> int:
    """An int >= 0 (0: the measurement it sizes is skipped)."""
    return _checked(text, int, lambda v: v >= 0, "an int >= 0")


def temperature(text: str) -> float:
    """A sampling temperature, checked by `SamplingParams` itself (the one place that says
    which are valid: 0 for greedy, or a finite number >= 1e-6)."""
    value = _checked(text, float, lambda v: True, "a number")
    try:
        SamplingParams(temperature=value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def seed(text: str) -> int:
    """An int in [0, 2**32): sampling seeds derived from it stay within [0, 2**63)."""
    return _checked(text, int, lambda v: 0 <= v < 2**32, "an int in [0, 2**32)")


def positive_ints(text: str) -> tuple[int, ...]:
    """Comma-separated ints >= 1, at least one."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints >= 1 (like 10,16,24), got {text!r}")
    return values


def model(text: str) -> Path:
    """A checkpoint directory or a hub id in the local HF cache (no network)."""
    from samebits.model.hub import resolve_model_path

    try:
        return resolve_model_path(text)
    except FileNotFoundError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device(text: str) -> str:
    """'cpu', or 'cuda[:N]' on a machine with CUDA, Triton and sm_80+."""
    from samebits.engine.config import check_device

    try:
        check_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def writable_file(text: str) -> Path:
    """A file path whose folder exists and is writable (the file itself may not exist yet)."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} is not writable")
    return path


def writable_dir(text: str) -> Path:
    """A folder that exists and is writable, or can be created (its nearest existing
    ancestor is a writable folder)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise argparse.ArgumentTypeError(f"{text} cannot be created: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text} is not writable ({probe} is read-only)")
    return path
