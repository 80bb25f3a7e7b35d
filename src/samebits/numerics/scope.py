"""Per-thread numerics state: is `batch_invariant()` open here, which profile is chosen here.

Both are thread-local: a thread that never entered a context sees stock kernels and the
default profile, whatever other threads do. One caveat comes from autograd itself: on CUDA
the backward runs on autograd's own device thread, which never entered, so backward GEMMs
there run stock kernels (the bitwise contract is about forward passes; on the CPU autograd
runs the backward on the calling thread, inside the context).
"""

from __future__ import annotations

import threading

_tls = threading.local()


def invariant_depth() -> int:
    """How many `batch_invariant()` contexts this thread has open."""
    return getattr(_tls, "depth", 0)


def add_invariant(step: int) -> None:
    _tls.depth = invariant_depth() + step


def profile_name() -> str:
    """The numerics profile chosen in this thread ("exact" unless a profile context says otherwise)."""
    stack = getattr(_tls, "profiles", None)
    return stack[-1] if stack else "exact"


def push_profile(name: str) -> None:
    if not hasattr(_tls, "profiles"):
        _tls.profiles = []
    _tls.profiles.append(name)


def pop_profile() -> None:
    _tls.profiles.pop()
