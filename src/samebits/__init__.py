"""samebits: an RL rollout engine whose sampled-token log-probs equal the
transformers trainer's recompute, bit for bit."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_LAZY = {
    "LLM": "samebits.engine.llm",
    "MultimodalPrompt": "samebits.requests",
    "RequestOutput": "samebits.engine.outputs",
    "SamplingParams": "samebits.requests",
    "batch_invariant": "samebits.numerics.batch_invariant",
}

if TYPE_CHECKING:
    from samebits.engine.llm import LLM
    from samebits.engine.outputs import RequestOutput
    from samebits.numerics.batch_invariant import batch_invariant
    from samebits.requests import MultimodalPrompt, SamplingParams


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    if name in ("trainer", "verify", "model", "engine", "kernels", "numerics"):
        return import_module(f"samebits.{name}")
    raise AttributeError(f"module 'samebits' has no attribute {name!r}")


__all__ = ["LLM", "MultimodalPrompt", "RequestOutput", "SamplingParams", "batch_invariant", "__version__"]
