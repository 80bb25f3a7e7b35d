"""Where a model lives: a local checkpoint directory, or a hub id in the local HF cache.

`resolve_model_path("Qwen/Qwen3-30B-A3B")` returns the cached snapshot directory
without touching the network (offline first: a missing model fails at once, with
the command that downloads it, instead of waiting on connection timeouts).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# huggingface_hub's repo id rule: "name" or "owner/name", letters, digits, "-", "_", "."
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


class ModelNotFoundError(FileNotFoundError):
    """Neither a local checkpoint directory nor a model in the local Hugging Face cache."""


def hub_cache_dir() -> Path:
    """The HF hub cache as huggingface_hub reads it: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (read now, so a changed environment counts)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def looks_like_hub_id(model: str) -> bool:
    """True for "owner/name" (or "name") spellings that are not path-like ("./x", "/x", "~x")."""
    return bool(_REPO_ID.match(model)) and ".." not in model


def resolve_model_path(model: str | os.PathLike) -> Path:
    """The checkpoint directory for `model`: itself when it is a directory, else the local
    HF cache's snapshot of the hub id `model` (no network). Raises ModelNotFoundError saying
    how to download it, or naming the missing directory."""
    if isinstance(model, bytes) or not isinstance(model, str | os.PathLike):
        raise TypeError(f"model must be a checkpoint directory or a hub id, got {type(model).__name__}")
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"model {str(model)!r} is a file; pass the checkpoint directory holding it")
    text = os.fspath(model)
    if not looks_like_hub_id(text):
        raise ModelNotFoundError(f"checkpoint directory {text} does not exist")
    snapshot = _cached_snapshot(text)
    if snapshot is None:
        raise ModelNotFoundError(
            f"model {text!r} is neither a local directory nor in the Hugging Face cache "
            f"({hub_cache_dir()}); download it first: `hf download {text}` "
            f"(older huggingface_hub: `huggingface-cli download {text}`), or pass a local path"
        )
    return snapshot


def _cached_snapshot(repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    if not (cache / f"models--{repo_id.replace('/', '--')}").is_dir():
        return None  # not cached: answered from the directory listing alone
    try:
        folder = snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"the cached snapshot {folder} of {repo_id!r} has no config.json (an incomplete download?); "
            f"run `hf download {repo_id}` again"
        )
    return folder
