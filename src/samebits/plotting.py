"""matplotlib is optional (`pip install 'samebits[plot]'`): the PNGs of `samebits rl` and
`samebits bench` need it, nothing else does. Without it those PNGs are skipped with a
message saying how to get them; every other output is written as usual."""

from __future__ import annotations

import sys

PLOT_EXTRA = "pip install 'samebits[plot]'"


def pyplot(what: str):
    """`matplotlib.pyplot` on the Agg backend (no display needed) to draw `what`, or None when
    matplotlib is not installed, after printing to stderr that `what` was not written and how
    to install the plot extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"samebits: {what} not written: matplotlib is not installed ({PLOT_EXTRA})", file=sys.stderr)
        return None
    return plt
