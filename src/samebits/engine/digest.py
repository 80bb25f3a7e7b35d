"""Weight digests: is the engine's tensor the trainer's, bit for bit?

Two kinds, compared only with their own kind:

- `"sha256"`: sha256 of the tensor's raw bytes, copied to the host. Cryptographic, and
  slow for a large model: a 30B model in bf16 is ~61 GB through one host core.
- `"fast"`: a 256-bit checksum computed where the tensor lives (CPU or CUDA), with no host
  copy of the data. NOT cryptographic: it detects accidental differences (a stale or
  partly copied tensor, one flipped bit, permuted or transposed words), not an adversary.

The fast digest. The tensor's logical bytes (row-major, whatever its strides) are read as
little-endian int64 words w_i, the last one zero-padded. In each of 4 lanes every word is
mixed with its global index i, and the lane is the SUM of the mixed words:

    z = w_i ^ (i * A + S)                        # the word at its position
    z = (z ^ (z >>> 30)) * M1                     # splitmix64's finalizer, per-lane
    z = (z ^ (z >>> 27)) * M2                     # multipliers: a bijection of z
    z =  z ^ (z >>> 31)
    lane = sum_i z   (mod 2**64)

All of it is int64 arithmetic that wraps mod 2**64 (the same bits on every device), and
integer addition is exact and associative, so the lanes do not depend on the device, the
chunking or the reduction order. Each step is a bijection of w_i for a fixed i, so a
change confined to one word (a flipped bit anywhere) changes every lane, always; a swap
of two different words changes a lane unless two 64-bit mixes happen to cancel. The
digest is sha256 over (dtype, shape, byte count, the 4 lanes): a tensor with the same
bytes but another dtype or shape gets another digest.

Cost. Eager: ~15 elementwise int64 passes over [4, words] temporaries per chunk
(`CHUNK_BYTES`), one device sync per tensor. Fused (the default for tensors of >= 32 MiB):
the same arithmetic as one `torch.compile`d reduction that reads each word once, compiled
once per process and device (seconds). Measured in benchmarks/digest_cost.py; docs/rl.md.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections.abc import Iterator

import torch

DIGEST_KINDS = ("fast", "sha256")
# input bytes per chunk; the [4, words] int64 temporaries are 4x this. CUDA: large enough
# that ~15 launches per chunk hide behind the work; CPU: temporaries that stay in cache
# (fused: meant to need none but the copies of a non-contiguous tensor's rows; see fast_lanes)
CHUNK_BYTES = {"cuda": 16 * 2**20, "cpu": 2**20, "fused": 256 * 2**20}
FUSED_MIN_BYTES = 32 * 2**20  # smaller tensors run eagerly by default: no compile for them
FUSED_MIN_WORDS = 4096  # and so do smaller chunks: no graph specialised to sizes 0 or 1

MASK64 = 2**64 - 1


def _s64(x: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return x - 2**64 if x >= 2**63 else x


# per lane: index multiplier A (odd), lane seed S (digits of pi), finalizer multipliers
# M1, M2 (odd; published mixers: splitmix64, murmur3 fmix64, xxhash64 primes, Stafford's
# Mix01). Sixteen different constants: the lanes share no multiplier
LANES = (
    (0x9E3779B97F4A7C15, 0x243F6A8885A308D3, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB),
    (0xC2B2AE3D27D4EB4F, 0x13198A2E03707344, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53),
    (0x165667B19E3779F9, 0xA4093822299F31D0, 0x9E3779B185EBCA87, 0x85EBCA77C2B2AE63),
    (0x27D4EB2F165667C5, 0x082EFA98EC4E6C89, 0x7FB5D329728EA185, 0x81DADEF4BC2DD44D),
)
SHIFTS = (30, 27, 31)


def tensor_digest(t: torch.Tensor, kind: str = "sha256") -> str:
    """Hex digest of a tensor's contents: `kind` "sha256" (raw bytes on the host; dtype and
    shape not hashed) or "fast" (`fast_digest`: on the tensor's device, not cryptographic)."""
    if kind == "sha256":
        return sha256_digest(t)
    if kind == "fast":
        return fast_digest(t)
    raise ValueError(f"digest kind must be one of {DIGEST_KINDS}, got {kind!r}")


def sha256_digest(t: torch.Tensor) -> str:
    """sha256 hex of a tensor's raw bytes (dtype and shape are not hashed)."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def fast_digest(t: torch.Tensor, chunk_bytes: int | None = None, fused: bool | None = None) -> str:
    """64 hex chars: the 4-lane wrapping-sum checksum of `t`'s logical contents (module
    docstring), computed on `t.device`. The same value on every device, for every
    `chunk_bytes` and either `fused` (see `fast_lanes`).
    Not cryptographic: use `sha256_digest` where tampering matters."""
    lanes = fast_lanes(t, chunk_bytes, fused)
    head = f"samebits-fast-v1|{t.dtype}|{tuple(t.shape)}|{t.numel() * t.element_size()}|"
    return hashlib.sha256((head + ",".join(f"{x:016x}" for x in lanes)).encode()).hexdigest()


def fast_lanes(t: torch.Tensor, chunk_bytes: int | None = None, fused: bool | None = None) -> list[int]:
    """The 4 lane sums of `t` as unsigned 64-bit ints (no dtype/shape: see `fast_digest`).

    chunk_bytes: input bytes per step (a multiple of 8, >= 16; default CHUNK_BYTES).
    fused: mix and sum in one `torch.compile`d kernel (meant as one read of the words; on
    the H200 its peak extra memory equalled the input, not yet explained; compiled once
    per process and device) instead of ~15 eager passes over
    [4, words] temporaries. Default: fused for tensors of >= FUSED_MIN_BYTES. Chunks of
    fewer than FUSED_MIN_WORDS words (a tensor's tail) always run eagerly: a compiled
    graph is kept for large sizes only. The bits are the same either way (exact integer
    arithmetic); if compiling fails the eager path runs, with a warning."""
    _check(t, chunk_bytes)
    nbytes = t.numel() * t.element_size()
    if fused is None:
        fused = nbytes >= FUSED_MIN_BYTES
    if chunk_bytes is None:
        chunk_bytes = CHUNK_BYTES["fused" if fused else "cpu" if t.device.type == "cpu" else "cuda"]
    dev = t.device
    consts = torch.tensor([[_s64(c) for c in lane] for lane in LANES], dtype=torch.int64, device=dev)
    acc = torch.zeros(len(LANES), dtype=torch.int64, device=dev)
    for start, words in _word_chunks(_byte_pieces(t.detach(), chunk_bytes)):
        first = torch.full((), start, dtype=torch.int64, device=dev)  # a fill: no host copy, no sync
        mix = _fused_mix_sum() if fused and words.numel() >= FUSED_MIN_WORDS else _mix_sum
        acc.add_(mix(words, first, consts))
    return [x & MASK64 for x in acc.tolist()]


def _mix_sum(words: torch.Tensor, first: torch.Tensor, consts: torch.Tensor) -> torch.Tensor:
    """[W] int64 words whose first has global index `first` (0-d) -> [4] lane sums of the
    mixed words (module docstring); consts: LANES as int64, [4, 4]."""
    a, s, m1, m2 = (consts[:, j : j + 1] for j in range(4))  # each [4, 1]
    idx = torch.arange(words.shape[0], dtype=torch.int64, device=words.device).add_(first)
    z = (idx * a).add_(s).bitwise_xor_(words)  # i * A + S, [4, W]
    for shift, m in zip(SHIFTS, (m1, m2, None), strict=True):
        z.bitwise_xor_(_shr(z, shift))
        if m is not None:
            z.mul_(m)
    return z.sum(dim=1)


@functools.cache
def _fused_mix_sum():
    """`_mix_sum` through torch.compile (sizes dynamic: one graph per device), or
    `_mix_sum` itself when compiling fails on the first call."""
    compiled = torch.compile(_mix_sum, dynamic=True, fullgraph=True)
    state = {"ok": True}

    def run(words, first, consts):
        if state["ok"]:
            try:
                return compiled(words, first, consts)
            except Exception as e:  # noqa: BLE001 - any compiler failure: the eager path has the same bits
                state["ok"] = False
                warnings.warn(
                    f"fast_digest: torch.compile failed ({e!r:.200}); using the eager path", stacklevel=3
                )
        return _mix_sum(words, first, consts)

    return run


def _shr(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 is arithmetic)."""
    return (z >> shift).bitwise_and_((1 << (64 - shift)) - 1)


def _check(t, chunk_bytes: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fast_digest: expected a tensor, got {type(t).__name__}")
    if t.is_meta or t.layout != torch.strided:
        raise ValueError("fast_digest: the tensor must be a dense tensor with data (not meta, not sparse)")
    if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or chunk_bytes < 16 or chunk_bytes % 8):
        raise ValueError(f"fast_digest: chunk_bytes must be a multiple of 8, >= 16, got {chunk_bytes!r}")


def _byte_pieces(t: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """t's logical contents in row-major order as 1-D uint8 tensors of <= max_bytes each:
    views of a contiguous tensor, else contiguous copies of row ranges (never the whole)."""
    if t.is_contiguous():
        flat = _flat_bytes(t)  # a view: no copy
        for i in range(0, flat.numel(), max_bytes):
            yield flat[i : i + max_bytes]
        return
    row_bytes = t[0].numel() * t.element_size()  # dim >= 1: a 0-d tensor is contiguous
    rows = max_bytes // row_bytes
    if rows == 0:  # one row is too big: split it
        for i in range(t.shape[0]):
            yield from _byte_pieces(t[i], max_bytes)
        return
    for i in range(0, t.shape[0], rows):
        yield _flat_bytes(t[i : i + rows].contiguous())


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view. A tensor of <= 1 element counts as
    contiguous whatever its strides; its flat view gets stride 1 (its one element)."""
    flat = t.reshape(-1)
    if flat.numel() <= 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def _word_chunks(pieces: Iterator[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """Byte pieces -> (index of the first word, 1-D int64 words); a piece's last < 8 bytes
    carry into the next one, and the final partial word is zero-padded."""
    start, carry = 0, None
    for piece in pieces:
        if carry is not None:
            piece = torch.cat([carry, piece])
        n = piece.numel() // 8 * 8
        if n:
            body = piece[:n]
            if body.data_ptr() % 8:  # an int64 view needs 8-byte alignment
                body = body.clone()
            yield start, body.view(torch.int64)
            start += n // 8
        carry = piece[n:] if n < piece.numel() else None
    if carry is not None:
        tail = torch.zeros(8, dtype=torch.uint8, device=carry.device)
        tail[: carry.numel()] = carry
        yield start, tail.view(torch.int64)
