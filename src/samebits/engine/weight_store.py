"""The engine's weights as one room: names, checked all-or-nothing updates, digests, release.

`WeightStore` holds the model's parameters under their transformers 5 names
(`model.named_parameters(remove_duplicate=False)`: a tied `lm_head.weight` is an alias of
`model.embed_tokens.weight`). An update names its tensors either that way or with the
hub's per-expert names, which write one expert's slice of a fused parameter:

    ...mlp.experts.{e}.gate_proj.weight [I, H] -> ...mlp.experts.gate_up_proj[e, :I]  ([E, 2I, H])
    ...mlp.experts.{e}.up_proj.weight   [I, H] -> ...mlp.experts.gate_up_proj[e, I:]
    ...mlp.experts.{e}.down_proj.weight [H, I] -> ...mlp.experts.down_proj[e]         ([E, H, I])

Every check (name, shape, dtype, a slice written twice, NaN/inf) runs on the whole request
before the first copy, so a refused update leaves every parameter bitwise as it was.

Release/resume: `release()` frees the parameters' storage; `resume()` allocates it again
(zeros) and marks every parameter not loaded. Loading is tracked per slice: a fused expert
parameter counts as loaded once each of its expert slices (or the whole tensor) was written
since the resume. `require_loaded` is what `generate` asks before running.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from samebits.engine.digest import DIGEST_KINDS, tensor_digest
from samebits.model.checkpoint_checks import listing, refuse_non_finite

# {prefix}.{e}.{gate,up,down}_proj.weight, prefix any module path ending in mlp.experts
_PER_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
WHOLE = "all"  # the one unit of a parameter that is not a fused expert tensor


@dataclass(frozen=True)
class Slot:
    """Where one update tensor goes: a whole parameter, or one expert's slice of a fused one."""

    param: str  # the parameter's first name (aliases of a tied tensor share it)
    shape: tuple[int, ...]  # what the given tensor must have
    expert: int | None = None
    part: str | None = None  # "gate", "up" or "down" for an expert slice

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """The part of parameter `p` this slot writes."""
        if self.expert is None:
            return p
        if self.part == "gate":
            return p[self.expert, : self.shape[0]]  # [I, H] of [E, 2I, H]
        if self.part == "up":
            return p[self.expert, self.shape[0] :]  # [I, H]
        return p[self.expert]  # [H, I] of [E, H, I]

    def units(self, all_units: frozenset) -> frozenset:
        """The loading units this slot covers (of the parameter's `all_units`)."""
        if self.expert is None:
            return all_units
        return frozenset({(self.expert, self.part)})


class WeightStore:
    """A model's parameters by HF name: checked updates, digests, release and resume.

    `owned`: False when the parameters are a colocated trainer's shared tensors
    (`LLM(weights=...)`); they are then never released."""

    def __init__(self, model: nn.Module, owned: bool = True):
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        self.owned = owned
        first: dict[int, str] = {}
        self._canon = {n: first.setdefault(id(p), n) for n, p in self.params.items()}  # alias -> first
        self._units = {n: _units_of(n, p) for n, p in self.params.items() if self._canon[n] == n}
        self._shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self._missing: dict[str, set] = {}  # parameter -> units not written since resume()
        self.released = False
        # parameters that share one storage (a layer's q/k/v, read back to back by the loader),
        # in storage order: resume() allocates each group as one buffer again
        by_storage: dict[tuple, list[str]] = {}
        for n in self._units:
            p = self.params[n]
            key = (p.untyped_storage().data_ptr(), p.dtype, p.device) if p.numel() else (n,)  # empty: alone
            by_storage.setdefault(key, []).append(n)
        self._groups = [
            sorted(names, key=lambda n: self.params[n].storage_offset()) for names in by_storage.values()
        ]

    # -- names ----------------------------------------------------------------------------

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{name: (shape, dtype)} of every parameter (tied aliases included), for clients."""
        return {n: (self._shapes[n], p.dtype) for n, p in self.params.items()}

    def slot(self, name: str, where: str) -> Slot:
        """Where `name` writes; KeyError naming it when this model has no such tensor."""
        if not isinstance(name, str):
            raise TypeError(f"{where}: a tensor name must be a str, got {type(name).__name__}")
        if name in self.params:
            return Slot(self._canon[name], self._shapes[name])
        target = per_expert_target(name, self._shapes)
        if target is None:
            raise KeyError(
                f"{where}: unknown parameter {name!r}; expected one of this model's transformers names "
                "(LLM.weight_store.param_specs()) or a hub per-expert name "
                "'<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight' of a sparse layer"
            )
        fused, e, part, shape = target
        num = self._shapes[fused][0]
        if e >= num:
            raise KeyError(f"{where}: unknown parameter {name!r}: expert {e}, but the model has {num} experts")
        return Slot(self._canon[fused], shape, e, part)

    def check_names(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[int]],
        where: str = "update_weights",
    ) -> list[Slot]:
        """Validate a declared update (no data): each name known, its shape and dtype what
        the model holds (dtype None: any, for a checkpoint cast on load), no slice written
        twice. `where` starts each message (the caller's name, e.g.
        "update_weights_from_distributed"). Raises KeyError/ValueError naming the tensor and
        saying what was expected; -> each tensor's slot, in order."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"{where}: names, dtypes and shapes must have one entry per tensor, "
                f"got {len(names)}, {len(dtypes)} and {len(shapes)}"
            )
        slots = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            slot = self.slot(name, where)
            if tuple(shape) != slot.shape:
                raise ValueError(f"{where}: {name} has shape {tuple(shape)}, expected {slot.shape}")
            want = self.params[slot.param].dtype
            if dtype is not None and dtype != want:
                raise ValueError(f"{where}: {name} has dtype {dtype}, expected {want} (the engine's dtype)")
            slots.append(slot)
        self.refuse_overlaps(names, slots, where)
        return slots

    def refuse_overlaps(self, names: Sequence[str], slots: Sequence[Slot], where: str) -> None:
        """ValueError when a name is given twice or two tensors write the same slice. The two
        names of a tied tensor are let through here; `update` checks that their values agree."""
        twice = sorted(n for n, c in Counter(names).items() if c > 1)
        if twice:
            raise ValueError(
                f"{where}: {listing(twice)} given more than once; give each tensor once per update"
            )
        seen: dict[tuple, str] = {}
        for name, slot in zip(names, slots, strict=True):
            for unit in slot.units(self._units[slot.param]):
                other = seen.setdefault((slot.param, unit), name)
                if other == name or (slot.expert is None and other in self.params):
                    continue  # first writer, or the other name of a tied tensor
                raise ValueError(
                    f"{where}: {name} writes what {other} writes too ({_unit_words(slot.param, unit)}); "
                    "give each slice once per update"
                )

    def units(self, slot: Slot) -> frozenset:
        """The loading units `slot` writes."""
        return slot.units(self._units[slot.param])

    def all_units(self) -> dict[str, frozenset]:
        """{parameter (the first name of each tensor): its loading units}."""
        return dict(self._units)

    # -- updates --------------------------------------------------------------------------

    def update(self, named_tensors, where: str = "update_weights") -> None:
        """Copy new values in by name (transformers or hub per-expert names): a {name: tensor}
        mapping or (name, tensor) pairs. All-or-nothing: names, shapes, dtypes, overlaps and
        values (NaN or inf, checked on the tensor's own device) first, then the copies."""
        self.refuse_released(where)
        staged = named_pairs(named_tensors, where)
        for name, tensor in staged:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{where}: {name} is a {type(tensor).__name__}, not a tensor")
            if tensor.is_meta or tensor.layout != torch.strided or hasattr(tensor, "device_mesh"):
                raise ValueError(f"{where}: {name} must be a plain dense tensor with data")
        names = [n for n, _ in staged]
        slots = self.check_names(names, [t.dtype for _, t in staged], [t.shape for _, t in staged], where)
        refuse_non_finite(staged, where)
        self._refuse_tied_disagreement(staged, slots, where)
        self.write([(s, t) for s, (_, t) in zip(slots, staged, strict=True)])

    def _refuse_tied_disagreement(self, staged, slots, where: str) -> None:
        first: dict[str, tuple[str, torch.Tensor]] = {}
        for (name, t), slot in zip(staged, slots, strict=True):
            if slot.expert is not None:
                continue
            other = first.setdefault(slot.param, (name, t))
            if other[0] != name and not torch.equal(other[1], t.to(other[1].device)):
                raise ValueError(
                    f"{where}: {other[0]} and {name} are one tied tensor in this model "
                    "(tie_word_embeddings) but the values given differ; give one of them"
                )

    def write(self, slotted: Iterable[tuple[Slot, torch.Tensor]]) -> None:
        """Copy checked tensors into their slots and mark those slices loaded."""
        with torch.no_grad():
            for slot, tensor in slotted:
                slot.view(self.params[slot.param]).copy_(tensor)
                self.mark_loaded(slot)

    def mark_missing(self, slots: Iterable[Slot]) -> None:
        """Mark slices not loaded (their copy failed): requests are refused until pushed."""
        for slot in slots:
            self._missing.setdefault(slot.param, set()).update(self.units(slot))

    def mark_loaded(self, slot: Slot) -> None:
        missing = self._missing.get(slot.param)
        if missing is not None:
            missing -= slot.units(self._units[slot.param])
            if not missing:
                del self._missing[slot.param]

    # -- digests --------------------------------------------------------------------------

    def digests(self, names, kind: str = "sha256") -> dict[str, str]:
        """Hex digest of each named parameter (all when names is None; a str is one name)."""
        if kind not in DIGEST_KINDS:
            raise ValueError(f"weight_digests: kind must be one of {DIGEST_KINDS}, got {kind!r}")
        if names is None:
            names = list(self.params)
        elif isinstance(names, str):
            names = [names]
        elif isinstance(names, Iterable) and not isinstance(names, bytes | bytearray):
            names = list(names)
        else:
            raise TypeError(
                f"weight_digests: names must be parameter names or None, got {type(names).__name__}"
            )
        for name in names:
            if not isinstance(name, str) or name not in self.params:
                raise KeyError(f"weight_digests: unknown parameter {name!r}")
        self.refuse_released("weight_digests")
        unloaded = [n for n in names if self._canon[n] in self._missing]
        if unloaded:
            raise RuntimeError(
                f"weight_digests: {len(unloaded)} tensor(s) not loaded since resume_memory_occupation(): "
                f"{listing(unloaded)}; push them first (update_weights / update_weights_from_disk)"
            )
        return {name: tensor_digest(self.params[name], kind) for name in names}

    # -- release / resume -----------------------------------------------------------------

    def release(self) -> None:
        """Free every parameter's storage (each becomes an empty tensor of its dtype and
        device); a no-op when released. RuntimeError for shared (not owned) weights."""
        if not self.owned:
            raise RuntimeError(
                "release_memory_occupation: this engine runs on a trainer's shared tensors "
                "(LLM(weights=...)) and does not own them; free them in the trainer instead"
            )
        if self.released:
            return
        for name in self._units:  # one per tensor: aliases share the parameter
            p = self.params[name]
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released = True

    def resume(self) -> None:
        """Allocate every released parameter again (zeros) and mark it not loaded; a no-op
        when the weights were not released. Parameters that shared one storage get one
        buffer again, back to back in their old order (so q/k/v stay one GEMM)."""
        if not self.released:
            return
        for names in self._groups:
            first = self.params[names[0]]
            sizes = [math.prod(self._shapes[n]) for n in names]
            buf = torch.zeros(sum(sizes), dtype=first.dtype, device=first.device)
            for name, part in zip(names, buf.split(sizes), strict=True):
                self.params[name].data = part.view(self._shapes[name])
                self._missing[name] = set(self._units[name])
        self.released = False

    def refuse_released(self, where: str) -> None:
        if self.released:
            raise RuntimeError(
                f"{where}: the weights are released (release_memory_occupation); call "
                "resume_memory_occupation(tags=['weights']) first, then push weights"
            )

    def require_loaded(self, where: str) -> None:
        """RuntimeError unless every parameter holds weights (what a request runs on)."""
        self.refuse_released(where)
        if self._missing:
            raise RuntimeError(
                f"{where}: {len(self._missing)} of {len(self._units)} weight tensor(s) are not loaded since "
                f"resume_memory_occupation() ({listing(sorted(self._missing))}); push weights with "
                "update_weights(...) or update_weights_from_disk(path) first"
            )

    @property
    def num_missing(self) -> int:
        """How many parameters are not (fully) written since the last resume."""
        return len(self._missing)


def per_expert_target(name: str, shapes: Mapping[str, Sequence[int]]) -> tuple[str, int, str, tuple] | None:
    """A hub per-expert name -> (its fused parameter, expert e, "gate" | "up" | "down", the
    slice's shape), read from the fused parameters' `shapes` ({name: shape}: gate_up_proj
    [E, 2I, H] -> [I, H]; down_proj [E, H, I] -> [H, I]); None when `name` is not such a name
    of a fused tensor in `shapes`. e may be out of range: the caller says so. (The engine's
    store and `samebits.client`, which checks against the server's specs, both use this.)"""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    part = m.group(3)
    fused = f"{m.group(1)}.{'down_proj' if part == 'down' else 'gate_up_proj'}"
    if fused not in shapes:
        return None
    _, rows, cols = shapes[fused]
    return fused, int(m.group(2)), part, ((rows, cols) if part == "down" else (rows // 2, cols))


def _units_of(name: str, p: torch.Tensor) -> frozenset:
    """A parameter's loading units: (expert, part) for fused expert tensors, else one."""
    kind = name.rpartition(".")[2]
    if ".mlp.experts." in name and kind in _FUSED and p.dim() == 3:
        return frozenset((e, part) for e in range(p.shape[0]) for part in _FUSED[kind])
    return frozenset({WHOLE})


def _unit_words(param: str, unit) -> str:
    return param if unit == WHOLE else f"{param} expert {unit[0]} {unit[1]}"


def named_pairs(named_tensors, where: str = "update_weights") -> list[tuple[str, torch.Tensor]]:
    """An update's input as a list of (name, tensor), refusing anything else clearly."""
    if isinstance(named_tensors, Mapping):
        return list(named_tensors.items())
    if isinstance(named_tensors, str | bytes | torch.Tensor) or not isinstance(named_tensors, Iterable):
        raise TypeError(
            f"{where} takes a {{name: tensor}} mapping or (name, tensor) pairs, "
            f"got {type(named_tensors).__name__}"
        )
    pairs = list(named_tensors)
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(f"{where}: item {i} is not a (name, tensor) pair: {type(pair).__name__}")
    return [tuple(p) for p in pairs]
