"""Ticket counters for kernels whose last program to finish a group finishes the work.

A kernel that splits one output's work over several programs (the split decode attention's
chunks; the router's linear over expert columns) can let the program that completes a group
last do the closing step (the chunk merge; the softmax and top-k) in the same launch: each
program stores its part, then (a barrier, and an acq_rel `atomic_add`) draws a ticket from
the group's counter; the program drawing the last one sees every part, does the closing step
and puts the counter back to 0.

`counters(owner, device, n)` is that kernel family's zeroed int32 buffer on `device`. Every
call that used it puts it back to zero, so one allocation serves every later call, CUDA graph
replays included: the engine runs each size eagerly before it captures it, so the allocation
is never captured, and a first call inside a capture is refused (the zeros would only be
written on replay). Each owner has its own buffer, so two kernel families never share a
counter. Calls of one owner on one device must not run at once on two streams: the engine's
decode runs on one.
"""

from __future__ import annotations

import torch

SIZE = 1024  # counters per (owner, device)
_BUFFERS: dict[tuple[str, int], torch.Tensor] = {}  # (owner, CUDA device index or -1 for the CPU)


def counters(owner: str, device: torch.device, n: int) -> torch.Tensor:
    """`owner`'s SIZE zeroed int32 counters on `device` (module docstring); n, the groups one
    call needs, must be <= SIZE."""
    if n > SIZE:
        raise ValueError(f"{owner}: a call of {n} ticket groups exceeds the {SIZE} counters of tickets.py")
    if device.type != "cuda":
        index = -1  # Triton's CPU interpreter
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
    buf = _BUFFERS.get((owner, index))
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{owner}: the first call on this device is inside a CUDA graph capture; run one call "
                "eagerly first (the engine warms each size up before capturing it)"
            )
        buf = _BUFFERS[(owner, index)] = torch.zeros(SIZE, dtype=torch.int32, device=device)
    return buf
