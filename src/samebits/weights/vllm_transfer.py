"""The receiving half of vLLM's NCCL weight-transfer protocol, without vLLM: the pieces that run
on any machine. Written from vLLM's source (vllm-project/vllm, read at commit 055e47c2 for
`backends/distributed/weight_transfer/nccl_common.py`, 00a9ccfb for `packed_tensor.py`,
`distributed/utils.py` StatelessProcessGroup); TRL 1.16.0's `VLLMClient` is its trainer.

- Rendezvous: the trainer is rank 0 and hosts a TCPStore at master_address:master_port (world
  size `world_size`, no libuv); each engine worker joins as a client with rank
  `rank_offset + worker_rank`.
- Unique id: rank 0 `broadcast_obj`s its `ncclUniqueId` (a ctypes struct of 128 bytes, pickled)
  under the store key `broadcast_from/0/<n>`, n = 0 for the first broadcast. It is unpickled
  here by an unpickler that admits only that struct, mapped onto our own layout.
- Packed buckets: tensors in `names` order, each as its contiguous bytes (uint8, no padding),
  concatenated; a bucket closes as soon as its byte count exceeds `packed_buffer_size_bytes`
  (1 GiB by default), the tensor that crossed the line included. The receiver computes the same
  plan from (shape, dtype) alone, receives each bucket into one uint8 buffer and splits it.

The NCCL communicator (ncclCommInitRank, the warm-up all-reduce, ncclBroadcast) is
`weights.nccl`; the engine's side of the four HTTP endpoints is `weights.vllm_receiver`.
"""

from __future__ import annotations

import ctypes
import io
import math
import pickle
from datetime import timedelta

import torch

DEFAULT_BUFFER_BYTES = 1024 * 1024 * 1024  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES
UNIQUE_ID_KEY = "broadcast_from/0/{n}"  # StatelessProcessGroup.broadcast_obj(src=0)
NCCL_UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES in nccl.h


class NcclUniqueId(ctypes.Structure):
    """nccl.h's `ncclUniqueId`: `char internal[128]` (vLLM's pynccl_wrapper spells it the same)."""

    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def bucket_plan(shapes: list[list[int]], dtypes: list[torch.dtype], buffer_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each packed bucket, in order, as vLLM's producer cuts them."""
    buckets, current, total = [], [], 0
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        current.append(i)
        total += math.prod(shape) * dtype.itemsize
        if total > buffer_bytes:
            buckets.append(current)
            current, total = [], 0
    if current:
        buckets.append(current)
    return buckets


def unpack(bucket: torch.Tensor, names, shapes, dtypes) -> list[tuple[str, torch.Tensor]]:
    """One received uint8 bucket -> [(name, tensor)]: views of `bucket` (clone to keep), or a
    copy for a tensor whose offset is not a multiple of its dtype's size (no padding: a
    float32 after three bfloat16 sits at byte 6), which torch cannot view."""
    sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
    if bucket.dtype != torch.uint8 or bucket.dim() != 1 or bucket.numel() != sum(sizes):
        raise ValueError(f"bucket: expected {sum(sizes)} uint8 bytes, got {tuple(bucket.shape)} {bucket.dtype}")
    parts = bucket.split(sizes)
    parts = [
        p if p.storage_offset() % d.itemsize == 0 else p.clone() for p, d in zip(parts, dtypes, strict=True)
    ]
    return [(n, p.view(d).view(s)) for n, p, s, d in zip(names, parts, shapes, dtypes, strict=True)]


class _UniqueIdUnpickler(pickle.Unpickler):
    # a peer's pickle is code: admit the ctypes rebuild and vLLM's ncclUniqueId, nothing else
    def find_class(self, module: str, name: str):
        if (module, name) == ("_ctypes", "_unpickle"):
            import _ctypes

            return _ctypes._unpickle
        if name == "ncclUniqueId" and module.endswith("device_communicators.pynccl_wrapper"):
            return NcclUniqueId
        raise pickle.UnpicklingError(f"unique id: refusing to unpickle {module}.{name}")


def load_unique_id(data: bytes) -> bytes:
    """vLLM's pickled ncclUniqueId -> its 128 bytes."""
    uid = _UniqueIdUnpickler(io.BytesIO(data)).load()
    if not isinstance(uid, NcclUniqueId):
        raise ValueError(f"unique id: expected vLLM's ncclUniqueId, got {type(uid).__name__}")
    return bytes(uid.internal)


def join_store(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float = 300.0):
    """Join rank 0's TCPStore as `rank` (a client, as StatelessProcessGroup.create does)."""
    if not (isinstance(world_size, int) and world_size >= 2 and 0 < rank < world_size):
        raise ValueError(f"rank_offset/world_size: rank {rank!r} must be in [1, world_size={world_size!r})")
    return torch.distributed.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        use_libuv=False,
    )


def receive_unique_id(store) -> bytes:
    """Block until rank 0 published its unique id; -> the 128 bytes."""
    return load_unique_id(store.get(UNIQUE_ID_KEY.format(n=0)))


def require_cuda(device: torch.device) -> None:
    """vLLM's transfer is NCCL: refuse at once, naming CUDA, where the engine is not on it."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            f"init_info: vLLM's NCCL weight transfer needs the engine on a CUDA device (NCCL runs "
            f"on CUDA only); this engine is on {device}"
        )
