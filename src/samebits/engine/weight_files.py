"""`update_weights_from_disk`: a checkpoint of the engine's own model, applied all or nothing.

1. Headers only: the checkpoint must be the same family with the same config.json shape
   (`_same_model`), and its tensors (fused or per-expert layout, one file or shards) must
   cover every parameter with the right shapes and float dtypes (`WeightStore.check_names`).
   A refusal here has read no tensor data.
2. Pass 1 reads every tensor, casts it to the engine's dtype on the engine's device (as the
   loaders do) and checks it finite, in batches of at most `BATCH_BYTES`, then drops it.
3. Pass 2 reads every tensor again and copies it into its parameter (or expert slice).

So a checkpoint with NaN/inf (or a tied lm_head that differs from the embedding) anywhere
leaves the old weights bitwise as they were, and memory beyond the weights stays bounded by
one batch. The files must not change between the passes (checked by size and mtime); should
a read still fail in pass 2, the tensors not yet copied are marked not loaded, so requests
are refused until weights are pushed again.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from samebits.engine.digest import tensor_digest
from samebits.engine.weight_store import Slot, WeightStore
from samebits.model import checkpoint_checks as checks
from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.families import family_for
from samebits.model.qwen3_moe.loader import _read_headers
from samebits.progress import maybe_progress

WHERE = "update_weights_from_disk"
BATCH_BYTES = 1 << 30  # pass 1 holds at most this many bytes of checkpoint tensors at once


@dataclass(frozen=True)
class _Entry:
    """One checkpoint tensor: where it is on disk and where it goes."""

    disk: str  # the name in the safetensors file
    file: Path
    slot: Slot
    nbytes: int  # in the engine's dtype


def load_from_disk(store: WeightStore, family, path: Path) -> None:
    """Copy the checkpoint at `path` into `store`'s parameters, all or nothing (module doc).
    Raises UnsupportedCheckpointError naming the field, file or tensor."""
    store.refuse_released(WHERE)
    entries = _plan(store, family, path)
    stamp = _stamp(entries)
    files = {e.file for e in entries}
    with ExitStack() as stack:
        handles = {f: stack.enter_context(checks.open_safetensors(f)) for f in sorted(files)}
        _check_values(store, entries, handles, path, many=len(files) > 1)
        if _stamp(entries) != stamp:
            raise UnsupportedCheckpointError(f"{WHERE}: {path} changed while it was read; nothing was copied")
        done = 0
        try:
            for e in maybe_progress(entries, "loading weights") if len(files) > 1 else entries:
                store.write([(e.slot, _read(store, handles, e))])
                done += 1
        except BaseException:  # a read failed halfway (I/O): what was not copied is not loaded
            store.mark_missing(e.slot for e in entries[done:])
            raise


def _plan(store: WeightStore, family, path: Path) -> list[_Entry]:
    """Every tensor of the checkpoint with its slot, checked from the headers alone."""
    rename = _same_model(family, path)
    on_disk = _read_headers(checks.weight_files(path))
    checks.refuse_non_float({n: t.dtype for n, t in on_disk.items()})
    named = {}
    for disk, t in on_disk.items():
        name = rename(disk)
        if name is None or checks.DERIVED_TENSORS.search(name):
            continue  # parts of the checkpoint the engine does not run; buffers recomputed on load
        if name in named:
            raise UnsupportedCheckpointError(f"tensor {name} is stored twice, as {named[name][0]} and {disk}")
        named[name] = (disk, t)
    names = list(named)
    shapes = [t.shape for _, t in named.values()]
    try:
        slots = store.check_names(names, [None] * len(names), shapes, f"{WHERE}: checkpoint {path}")
    except (KeyError, ValueError) as e:
        raise UnsupportedCheckpointError(e.args[0]) from None
    _refuse_incomplete(store, slots, path)
    itemsize = {s.param: store.params[s.param].element_size() for s in slots}
    return [
        _Entry(disk, t.file, s, itemsize[s.param] * _numel(t.shape))
        for (disk, t), s in zip(named.values(), slots, strict=True)
    ]


def _same_model(family, path: Path):
    """Refuse a checkpoint of another family or config shape; -> its disk name -> engine name."""
    if family_for(path) is not type(family):
        raise UnsupportedCheckpointError(
            f"{WHERE}: {path} is a {family_for(path).name} checkpoint, but this engine runs "
            f"{family.name}; load it in a new LLM instead"
        )
    return family.checkpoint_names(path, WHERE)


def _refuse_incomplete(store: WeightStore, slots: list[Slot], path: Path) -> None:
    """Every parameter must be written (a tied lm_head may be absent), every expert slice too."""
    covered: dict[str, set] = {}
    for s in slots:
        covered.setdefault(s.param, set()).update(store.units(s))
    missing = [n for n, units in store.all_units().items() if not units <= covered.get(n, set())]
    if missing:
        raise UnsupportedCheckpointError(
            f"{WHERE}: {path} lacks (some expert slices of) {len(missing)} tensor(s) this model has: "
            f"{checks.listing(missing)}; is it a complete checkpoint of this model?"
        )


def _check_values(store: WeightStore, entries: list[_Entry], handles, path: Path, many: bool) -> None:
    """Pass 1: every tensor finite in the engine's dtype; the two names of a tied tensor equal."""
    twice = Counter(e.slot.param for e in entries if e.slot.expert is None)
    tied: dict[str, set[str]] = {}  # a tied parameter stored under both names -> their digests
    batch, size = [], 0
    for e in maybe_progress(entries, "checking weights") if many else entries:
        t = _read(store, handles, e)
        if e.slot.expert is None and twice[e.slot.param] > 1:
            tied.setdefault(e.slot.param, set()).add(tensor_digest(t))
        batch.append((e.disk, t))
        size += e.nbytes
        if size >= BATCH_BYTES:
            checks.refuse_non_finite(batch, f"checkpoint {path}")
            batch, size = [], 0
    checks.refuse_non_finite(batch, f"checkpoint {path}")
    unequal = [p for p, digests in tied.items() if len(digests) > 1]
    if unequal:
        raise UnsupportedCheckpointError(
            f"checkpoint {path}: tie_word_embeddings is true but the two tensors stored for {unequal[0]} "
            "(lm_head.weight and model.embed_tokens.weight) differ; fix tie_word_embeddings in config.json"
        )


def _read(store: WeightStore, handles, e: _Entry) -> torch.Tensor:
    p = store.params[e.slot.param]
    return handles[e.file].get_tensor(e.disk).to(device=p.device, dtype=p.dtype)


def _stamp(entries: list[_Entry]) -> dict[Path, tuple[int, int]]:
    stats = {f: f.stat() for f in {e.file for e in entries}}
    return {f: (st.st_size, st.st_mtime_ns) for f, st in stats.items()}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
