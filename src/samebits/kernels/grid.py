"""Host arithmetic for launch grids and block sizes: `triton.cdiv` and `triton.next_power_of_2`'s
results, in plain Python (no Triton import; tested on the CPU).

In Triton 3.6 those two are `constexpr_function`s, usable inside kernels; called from host code
each goes through `ConstexprFunction.__call__` (an import and the unwrapping of every argument):
~7 us a call on CI's 2-core CPU against ~0.3 for these, and a launcher makes one to four such
calls a launch, on every launch the trainer and the engine's eager steps make.
"""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for ints (`triton.cdiv`)."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n for n >= 1, and 0 for 0 (`triton.next_power_of_2`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
