"""Fixed-size KV blocks: reference counts, a free list, prefix sharing. Pure Python.

Prefix sharing (vLLM's automatic prefix caching, `enable_prefix_caching=True`): block b of
a sequence holds its tokens [b * block_size, (b + 1) * block_size). Once a block is full
and scheduled (its K/V are written by the end of that step), it is published under a
chained hash, sha256(parent block's hash, its token ids, an extra key), in `cached`. A
sequence admitted later (the other n samples of a request, a request with the same prompt
prefix, a preempted sequence coming back) takes the longest chain of its own full blocks
found there, by reference, instead of computing them: the K/V of a token depend only on
the tokens up to it (and the weights), and every kernel is batch invariant, so the shared
K/V are the bits the sequence would have computed itself.

Copy on write, with nothing to copy: only full blocks are shared and a hit always stops
before the sequence's last token (its logits are needed), at a block boundary, so a
sequence never writes into a shared block. Its first divergent (or partial) block is its
own, fresh from the free list.

Only text sequences share (`family_state is None`): a multimodal prompt's K/V also depend
on its images/audio and its M-RoPE positions, which the hash does not see, so such a
sequence neither looks up nor publishes (the safe choice; see docs/design.md).

Free list: blocks with reference count 0, in eviction order. A freed block with a hash
joins the newest end (least recently used first, a sequence's last block before its
first); one without a hash joins the oldest end, so it is reused before any cached K/V.
Reusing a cached block drops its hash. Cached-but-free blocks count as free everywhere.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from samebits.engine.sequence import Sequence


class BlockManager:
    """Hands out KV-cache blocks of `block_size` token slots, shared by reference count.

    Token i of a sequence lives in slot `block_table[i // block_size] * block_size + i % block_size`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # chained hash -> the block holding those K/V
        self.epoch = 0  # bumped by reset_prefix_cache; a sequence publishes only in its own epoch

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included (they are evicted on demand)."""
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
        for _ in range(need):
            block, _ = self.free_blocks.popitem(last=False)
            self._drop_hash(block)  # evicted: its K/V are about to be overwritten
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; its cached K/V are gone for it, so nothing counts as computed.
        Blocks nobody holds any more join the free list (see the module docstring)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                if self.block_hash[block] is None:
                    self.free_blocks.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    # -- prefix sharing -------------------------------------------------------------------

    def shares(self, seq: Sequence) -> bool:
        """Whether seq takes part in prefix sharing (caching on, a text prompt)."""
        return self.enable_prefix_caching and seq.family_state is None

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks of the longest cached chain of seq's full blocks, at most its first
        num_tokens - 1 tokens (the last token is always computed: it gives the logits).
        seq holds no blocks (a waiting sequence). [] when seq does not share."""
        if not self.shares(seq) or _scoring(seq):
            return []
        n = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in self._hashes(seq, n)[:n]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def admission_cost(self, hits: list[int], num_tokens: int) -> int:
        """Free-list blocks an admission takes: the hits nobody holds, and new blocks for
        the rest of its first num_tokens tokens."""
        idle = sum(1 for b in hits if self.ref_counts[b] == 0)
        return idle + max(0, self.blocks_for(num_tokens) - len(hits))

    def take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Give seq (holding no blocks) the cached blocks `hits` by reference: their tokens
        count as computed. Starts seq's prefix-cache epoch."""
        if seq.block_table:
            raise RuntimeError(f"take_prefix: sequence {seq.seq_id} already holds blocks")
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        seq.cache_epoch = self.epoch

    def publish(self, seq: Sequence, num_tokens: int) -> None:
        """Publish seq's blocks that are full within its first num_tokens tokens, whose K/V
        the step being scheduled writes (or an earlier one wrote). A block whose hash is
        already cached elsewhere stays private (same K/V, one copy is enough)."""
        full = num_tokens // self.block_size
        if full <= seq.num_hashed_blocks or not self.shares(seq) or seq.cache_epoch != self.epoch:
            return  # (most decode steps fill no block)
        hashes = self._hashes(seq, full)
        for b in range(seq.num_hashed_blocks, full):
            block, h = seq.block_table[b], hashes[b]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h
        seq.num_hashed_blocks = full

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (new weights, a zeroed cache, another numerics profile):
        no later lookup hits a block published before. Safe with sequences in flight: those
        keep their blocks, and publish nothing more until recomputed from token 0."""
        for block in self.cached.values():
            self.block_hash[block] = None
        self.cached.clear()
        self.epoch += 1

    def _hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """seq's chained block hashes, computed up to its first n full blocks at least
        (memoised on seq: its tokens only grow)."""
        bs, hashes = self.block_size, seq.block_hashes
        extra = self._extra_key(seq)
        while len(hashes) < n:
            b = len(hashes)
            parent = hashes[-1] if hashes else b""
            hashes.append(self._block_hash(parent, seq.token_ids[b * bs : (b + 1) * bs], extra))
        return hashes

    @staticmethod
    def _block_hash(parent: bytes, token_ids: list[int], extra: bytes) -> bytes:
        """sha256 over (parent hash, token ids as int64, extra key): equal hashes mean the same
        tokens from position 0, so the same K/V. Collisions are not a practical concern."""
        h = hashlib.sha256(parent)
        h.update(array("q", token_ids).tobytes())
        h.update(extra)
        return h.digest()

    @staticmethod
    def _extra_key(seq: Sequence) -> bytes:
        """What else the block's K/V depend on, besides token ids and weights: nothing for a
        text sequence (the only kind that shares). Weights and numerics profile changes reset
        the cache instead (`reset_prefix_cache`)."""
        return b""

    def _drop_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _scoring(seq: Sequence) -> bool:
    """Whether seq has prompt positions left to score (`prompt_logprobs`): every one of them
    must be computed, so it reads nothing from the cache (vLLM's skip_reading_prefix_cache)."""
    return seq.prompt_scores is not None and seq.num_prompt_scored < seq.num_prompt_tokens - 1
