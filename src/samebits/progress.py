"""Progress on long work: a rich bar on a terminal, silence elsewhere."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def maybe_progress(items: Iterable[T], label: str, min_items: int = 2) -> Iterator[T]:
    """Iterate items, with a transient rich progress bar when stderr is a TTY and there are many."""
    items = list(items)
    if len(items) < min_items or not sys.stderr.isatty():
        yield from items
        return
    from rich.console import Console
    from rich.progress import track

    yield from track(items, description=label, transient=True, console=Console(stderr=True))
