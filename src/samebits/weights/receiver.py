"""The engine's side of weight sync from another process (SGLang's HTTP protocol).

One `WeightReceiver` per engine, in the engine's process, called between steps (the engine
process's loop runs these while no request is in flight: see `engine_child`):

- `init_weights_update_group`: join the trainer's named group (`weights.group`) as rank
  `rank_offset` (one engine, no tensor parallelism).
- `update_weights_from_distributed`: the declared names, dtypes and shapes are checked
  against the model first (`check_distributed`, run as soon as the request arrives, so a
  refused update answers at once instead of waiting on the group); then each tensor is
  received from rank 0's broadcast, in `names` order, into a staging buffer; then all are
  applied at once through `LLM.update_weights` (finite values checked), or none is. A
  broken connection halfway refuses the update naming the tensor it was receiving, keeps
  the old weights, and destroys the group (a collective that failed leaves it unusable).
- `update_weights_from_tensor`: tensors by reference (CUDA IPC handles, `weights.ipc`),
  copied into the parameters all or nothing.

Staging memory is the size of one request: a trainer that sends the model in buckets (one
request per bucket) bounds it, and then each bucket is all-or-nothing on its own.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from samebits.weights import group as groups
from samebits.weights import ipc

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


def parse_dtype(i: int, text, field: str = "dtypes") -> torch.dtype:
    """ "bfloat16" or "torch.bfloat16" (as SGLang's and vLLM's clients send them) -> torch dtype;
    ValueError naming `field`[i] otherwise."""
    name = str(text).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{field}[{i}]: {text!r} is not a torch dtype name (e.g. 'bfloat16')")
    return dtype


class WeightReceiver:
    """Process groups by name, and the update paths that read from them."""

    def __init__(self, llm):
        self.llm = llm
        self.groups: dict[str, object] = {}
        self.joining: set[str] = set()  # groups whose rendezvous is under way (in a thread)

    # -- the group ----------------------------------------------------------------------

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
    ) -> str:
        if group_name in self.groups or group_name in self.joining:
            raise ValueError(
                f"group_name: a group {group_name!r} already exists; "
                "POST /destroy_weights_update_group first, or use another name"
            )
        if backend == "nccl" and not self.llm.runner.device.type == "cuda":
            raise ValueError("backend: 'nccl' needs the engine on a CUDA device; use 'gloo' on the CPU")
        if backend == "nccl":
            torch.cuda.set_device(self.llm.runner.device)
        t0 = time.perf_counter()
        self.joining.add(group_name)
        try:
            self.groups[group_name] = groups.init_custom_process_group(
                backend, master_address, master_port, world_size, rank_offset, group_name
            )
        finally:
            self.joining.discard(group_name)
        took = time.perf_counter() - t0
        return f"joined group {group_name!r} as rank {rank_offset} of {world_size} in {took:.2f} s"

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> str:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"group_name: no group {group_name!r}")
        groups.destroy(group)
        return f"destroyed group {group_name!r}"

    # -- updates ------------------------------------------------------------------------

    def check_distributed(self, names, dtypes, shapes, group_name: str = DEFAULT_GROUP, **_) -> list:
        """Everything checkable before a byte is received -> [(name, dtype, shape)]."""
        if group_name not in self.groups:
            raise ValueError(
                f"group_name: no weight update group {group_name!r}; POST /init_weights_update_group first"
            )
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(
                "update_weights_from_distributed: names, dtypes and shapes must have one entry per "
                f"tensor, got {len(names)}, {len(dtypes)} and {len(shapes)}"
            )
        if not names:
            raise ValueError("names: empty update")
        declared = [
            (name, parse_dtype(i, d), tuple(int(x) for x in s))
            for i, (name, d, s) in enumerate(zip(names, dtypes, shapes, strict=True))
        ]
        where = "update_weights_from_distributed"
        self.llm.weight_store.check_names(*zip(*declared, strict=True), where=where)
        return declared

    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name: str = DEFAULT_GROUP, flush_cache: bool = True, **_
    ) -> str:
        # checked on arrival too (engine_child.PRECHECK); again here, as a release or a destroyed
        # group may have come between (no data is involved: microseconds)
        declared = self.check_distributed(names, dtypes, shapes, group_name)
        group = self.groups[group_name]
        device = self.llm.runner.device if _backend(group) == "nccl" else torch.device("cpu")
        t0, staged = time.perf_counter(), []
        for i, (name, dtype, shape) in enumerate(declared):
            buf = torch.empty(shape, dtype=dtype, device=device)
            try:
                dist.broadcast(buf, src=0, group=group)
            except Exception as e:  # noqa: BLE001 - any transport error: refuse, keep the old weights
                self.groups.pop(group_name, None)
                groups.destroy(group)
                raise ConnectionError(
                    f"receiving {name} (tensor {i + 1} of {len(declared)}) failed: {e}; nothing was "
                    f"applied, the old weights keep serving; group {group_name!r} was destroyed, "
                    "POST /init_weights_update_group again"
                ) from e
            staged.append((name, buf))
        received = time.perf_counter()
        self.llm.update_weights(staged)
        nbytes = sum(t.numel() * t.element_size() for _, t in staged)
        return (
            f"updated {len(staged)} tensors ({nbytes / 2**20:.1f} MiB): received in "
            f"{received - t0:.3f} s, applied in {time.perf_counter() - received:.3f} s"
        )

    def update_weights_from_tensor(
        self, serialized_named_tensors, load_format: str | None = None, flush_cache: bool = True, **_
    ) -> str:
        if load_format not in (None, "direct", "flattened_bucket"):
            raise ValueError(
                f"load_format: {load_format!r} is not supported; leave it out (or 'direct', or "
                "'flattened_bucket': SGLang's FlattenedTensorBucket)"
            )
        if not isinstance(serialized_named_tensors, list) or len(serialized_named_tensors) != 1:
            raise ValueError(
                "serialized_named_tensors: one entry per tensor-parallel rank; this engine has one rank"
            )
        t0 = time.perf_counter()
        read = ipc.deserialize_bucket if load_format == "flattened_bucket" else ipc.deserialize
        named = read(serialized_named_tensors[0])
        opened = time.perf_counter()
        self.llm.update_weights(named)
        if self.llm.runner.device.type == "cuda":
            torch.cuda.synchronize(self.llm.runner.device)  # the trainer may reuse its memory after we answer
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        return (
            f"updated {len(named)} tensors ({nbytes / 2**20:.1f} MiB): opened in {opened - t0:.3f} s, "
            f"applied in {time.perf_counter() - opened:.3f} s"
        )

    # -- reading the weights ------------------------------------------------------------

    def weight_digests(self, names=None, kind: str = "sha256") -> dict:
        return {"digests": self.llm.weight_digests(names, kind)}

    def weight_specs(self, names=None) -> dict:
        specs = self.llm.weight_store.param_specs()
        for name in names or ():
            if name not in specs:
                raise KeyError(f"weight_specs: unknown parameter {name!r}")
        return {
            "specs": {
                n: {"shape": list(specs[n][0]), "dtype": str(specs[n][1]).removeprefix("torch.")}
                for n in (names or specs)
            }
        }

    def flush_cache(self) -> str:
        """Drop the prefix cache (runs when nothing is in flight: see engine_child)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("flush_cache: requests are in flight")
        return "cache flushed"


def _backend(group) -> str:
    return str(dist.get_backend(group))
