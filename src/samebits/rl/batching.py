"""Mini-batches (one optimizer step each) and micro-batches packed to a token budget. Plain Python."""

from __future__ import annotations

from collections.abc import Sequence


def split_mini_batches(num_sequences: int, mini_batches: int) -> list[list[int]]:
    """Contiguous, near-equal slices of range(num_sequences), in order; the first ones are larger."""
    if not 1 <= mini_batches <= num_sequences:
        raise ValueError(f"mini_batches must be in [1, {num_sequences}], got {mini_batches}")
    base, extra = divmod(num_sequences, mini_batches)
    out, start = [], 0
    for i in range(mini_batches):
        size = base + (i < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def pack_micro_batches(indices: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Pack sequences into micro-batches of at most `budget` tokens each (first-fit decreasing).

    Each micro-batch is one packed forward. A sequence longer than the budget gets a
    micro-batch of its own. Within a micro-batch indices are in ascending order.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]
