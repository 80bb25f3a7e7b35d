"""Per-thread numerics state: is `batch_invariant()` open here, which profile is chosen here.

Both are thread-local: a thread that never entered a context sees stock kernels and the
default profile, whatever other threads do. One caveat comes from autograd itself: on CUDA
the backward runs on autograd's own device thread, which never entered, so backward GEMMs
there run stock kernels (the bitwise contract is about forward passes; on the CPU autograd
runs the backward on the calling thread, inside the context).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_tls = threading.local()


def invariant_depth() -> int:
    """How many `batch_invariant()` contexts this thread has open."""
    return getattr(_tls, "depth", 0)


def add_invariant(step: int) -> None:
    _tls.depth = invariant_depth() + step


@contextlib.contextmanager
def stock() -> Iterator[None]:
    """Stock kernels in this thread until the block ends, inside `batch_invariant()` or not
    (for work with no bitwise contract, such as what a backward differentiates)."""
    depth = invariant_depth()
    _tls.depth = 0
    try:
        yield
    finally:
        _tls.depth = depth


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
