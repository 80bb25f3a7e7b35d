"""Fixed-size KV blocks: a free list and a block table per sequence. Pure Python."""

from __future__ import annotations

from collections import deque

from samebits.engine.sequence import Sequence


class BlockManager:
    """Hands out KV-cache blocks of `block_size` token slots; no prefix caching.

    Token i of a sequence lives in slot `block_table[i // block_size] * block_size + i % block_size`.
    """

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks seq needs so that its first num_tokens tokens have cache slots."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq.block_table to cover its first num_tokens tokens, all or nothing."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"need {need} KV blocks, {len(self.free_blocks)} free")
        seq.block_table.extend(self.free_blocks.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        """Return seq's blocks; its cached K/V are gone, so nothing counts as computed."""
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
