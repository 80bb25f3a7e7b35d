"""The weight-update process group, made as SGLang's server makes it.

A trainer (rank 0) and the engine(s) (ranks `rank_offset`...) join a named group of their
own over a TCP store that rank 0 hosts at `master_address:master_port`. The group is not
the default group (the trainer has its own, from torchrun), so it is built as SGLang's
`init_custom_process_group` builds it, which slime, AReaL and OpenRLHF mirror: rendezvous
on `tcp://addr:port`, a `PrefixStore(group_name, store)`, then torch's process-group helper
with the group's name. A trainer written for SGLang joins this group unchanged, and
`samebits.client` uses this same function for its side.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default_pg_timeout


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta = DEFAULT_TIMEOUT,
):
    """Join (rank 0: host) the named group -> a `ProcessGroup` usable as `group=` in
    `torch.distributed.broadcast`. Blocks until all `world_size` ranks joined or `timeout`."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not (isinstance(world_size, int) and world_size >= 2):
        raise ValueError(f"world_size must be an int >= 2 (the trainer and an engine), got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank {rank!r} is not in [0, world_size={world_size})")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"  # renamed in torch 2.6
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout, **{options: None}
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy(group) -> None:
    """Tear the group down (after a broken connection, or on request)."""
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError, KeyError):  # already gone, or half-built
        pass
