"""RL checkpoints: one file of plain data, written atomically, loaded without running code.

A checkpoint holds the trainer's state dict, the AdamW state, the step, the torch/python
(and CUDA) RNG states and the config, as tensors, numbers, strings, tuples, lists and
dicts only. It is read with `torch.load(weights_only=True)`: a file holding anything
else (a pickle that would import or call code) is refused before any of it runs. It is
written to a temporary file in the same folder, fsynced, then renamed over the old one,
so a crash leaves either the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import os
import pickle
import random
from dataclasses import asdict, fields
from pathlib import Path

import torch

from samebits.rl.config import RLConfig

FORMAT = "samebits-rl-checkpoint/1"
# how many steps to run now, where to log, how the weights are checked: not the run's state
ALWAYS_ALLOWED = ("steps", "out_dir", "digest_kind")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: unreadable, not plain data, or from another config."""


def save(path: str | Path, config: RLConfig, step: int, model, optimizer) -> Path:
    """Write the state atomically (temp file, fsync, os.replace, fsync of the folder) -> path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "format": FORMAT,
        "config": asdict(config),
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": _rng_state(),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # the old checkpoint, if any, is untouched
        raise
    _fsync_dir(path.parent)
    return path


def load(path: str | Path) -> dict:
    """Read a checkpoint as plain data (weights_only=True); raises CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # RNG states must stay on CPU
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {path}: refused, it holds more than tensors and plain data "
            f"(loaded with weights_only=True, nothing in it was run): {first}"
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: not a samebits RL checkpoint (no format {FORMAT!r})")
    missing = [k for k in ("config", "step", "model", "optimizer", "rng") if k not in state]
    if missing or not isinstance(state["step"], int) or state["step"] < 0:
        raise CheckpointError(f"checkpoint {path}: missing or bad entries {missing or ['step']}")
    return state


def check_config(saved: dict, config: RLConfig, allow_changes: tuple[str, ...] = ()) -> None:
    """Refuse a config that differs from the checkpoint's, except fields in ALWAYS_ALLOWED
    and `allow_changes`; the error names each field with its old and new values."""
    now = asdict(config)
    # a field newer than the checkpoint reads as its default (the value the run had)
    saved = {f.name: f.default for f in fields(RLConfig) if f.name not in saved} | saved
    changed = [
        f"{k}: {_plain(saved.get(k))!r} -> {_plain(now.get(k))!r}"
        for k in sorted(set(saved) | set(now))
        if k not in ALWAYS_ALLOWED and k not in allow_changes and _plain(saved.get(k)) != _plain(now.get(k))
    ]
    if changed:
        names = ",".join(c.split(":")[0] for c in changed)
        raise CheckpointError(
            f"resume: the config differs from the checkpoint's ({'; '.join(changed)}); "
            f"to run on the new values pass --allow-change {names}"
        )


def check_allowed_names(allow_changes: tuple[str, ...]) -> None:
    """Every name in `allow_changes` must be an RLConfig field."""
    known = {f.name for f in fields(RLConfig)}
    unknown = [n for n in allow_changes if n not in known]
    if unknown:
        raise ValueError(f"--allow-change: unknown config field(s) {unknown}; fields: {sorted(known)}")


def apply(state: dict, model, optimizer) -> None:
    """Load the model and optimizer states and the RNG states (strict: every tensor by name)."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint does not fit this model/optimizer: {e}") from e
    _set_rng_state(state["rng"])


def _plain(value):
    """Tuples and lists compare equal (a checkpoint keeps tuples; JSON would make lists)."""
    return [_plain(v) for v in value] if isinstance(value, tuple | list) else value


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
