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


class GenerateProgress:
    """A rich progress bar over the finished requests of one `LLM.generate` call (stderr), with
    the tokens its steps ran."""

    def __init__(self, total: int):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._p = Progress(
            TextColumn("generate"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[tok]} tok"),
            TimeElapsedColumn(),
            transient=True,
            console=Console(stderr=True),
        )
        self._task = self._p.add_task("generate", total=total, tok=0)
        self._tokens = 0
        self._p.start()

    def advance(self, finished: int, tokens: int) -> None:
        self._tokens += tokens
        self._p.update(self._task, advance=finished, tok=self._tokens)

    def close(self) -> None:
        self._p.stop()
