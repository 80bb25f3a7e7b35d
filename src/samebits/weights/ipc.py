"""Tensors handed over by reference, serialized as SGLang's `update_weights_from_tensor` does.

A colocated trainer (same GPU, another process) pickles its `[(name, tensor), ...]` with
`multiprocessing`'s ForkingPickler, whose torch reductions turn a CUDA tensor into a CUDA
IPC memory handle (no copy), and sends the pickle base64-encoded. The engine opens the
handles and copies from the trainer's memory into its parameters. NCCL cannot put two
ranks on one GPU; this is how verl's and SGLang's hybrid engines share one.

CPU tensors travel through shared-memory files (`file_system` sharing strategy), so the
same path works on a CPU-only machine.

Unpickling is restricted to the globals a list of tensors needs (torch's rebuild functions,
storage classes, dtypes): a pickle naming anything else is refused, so a request body
cannot run code in the engine.

`load_format="flattened_bucket"` (slime's colocated sync, SGLang 0.5's `FlattenedTensorBucket`):
each entry pickles `{"flattened_tensor": uint8 [bytes], "metadata": [FlattenedTensorMetadata]}`,
every tensor's bytes back to back (`tensor.flatten().view(torch.uint8)`, concatenated; one bucket
may mix dtypes) and, per tensor, its name, shape, dtype and byte range. `deserialize_bucket` reads
it: the metadata class at the two paths SGLang releases pickle it from is read into `BucketEntry`
(its fields, no code of SGLang's), and each tensor is a view of the bucket's bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
from dataclasses import dataclass, fields
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp
import torch.multiprocessing.reductions  # noqa: F401 - registers the tensor reductions

_REBUILDERS = "torch.multiprocessing.reductions"
# the rebuild functions torch's tensor and storage reductions pickle, by exact name (never a
# prefix: a pickle of protocol 4 may name a dotted attribute path, `rebuild_tensor.__globals__...`)
_REBUILD = (
    "rebuild_tensor",
    "rebuild_cuda_tensor",
    "rebuild_meta_tensor",
    "rebuild_storage_filename",
    "rebuild_storage_fd",
    "rebuild_storage_empty",
    "rebuild_typed_storage",
    "rebuild_typed_storage_child",
)
# SGLang's `monkey_patch_torch_reductions` (slime calls it before serializing): a CUDA tensor
# pickles as this function, with the device given as its UUID rather than an index
_SGLANG_CUDA_REBUILD = {
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"),
}
_DEVICE_ARG = 6  # rebuild_cuda_tensor's device argument
_ALLOWED = {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
}


def serialize(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """[(name, tensor)] -> base64 text of their pickle. CUDA tensors become IPC handles; the
    caller keeps the tensors alive (and unchanged) until the engine answered."""
    if torch_mp.get_sharing_strategy() != "file_system" and any(not t.is_cuda for _, t in named_tensors):
        torch_mp.set_sharing_strategy("file_system")  # file names, not fds: plain bytes over HTTP
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(list(named_tensors))
    return base64.b64encode(buf.getvalue()).decode("ascii")


# SGLang's FlattenedTensorMetadata: sglang.srt.weight_sync.tensor_bucket since 0.5 (slime falls
# back to the older sglang.srt.model_executor.model_runner import)
_BUCKET_METADATA = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"),
}


@dataclass
class BucketEntry:
    """One tensor of a flattened bucket: SGLang's FlattenedTensorMetadata fields (byte range
    [start_idx, end_idx) of the bucket, numel its byte count)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class _Unpickler(pickle.Unpickler):
    buckets = False  # whether SGLang's bucket metadata may be named

    def find_class(self, module: str, name: str):
        if self.buckets and (module, name) in _BUCKET_METADATA:
            return BucketEntry
        if (module, name) in _SGLANG_CUDA_REBUILD:
            return _rebuild_cuda_tensor_by_uuid
        allowed = (module, name) in _ALLOWED or (module == _REBUILDERS and name in _REBUILD)
        if module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed or "." in name:
            raise pickle.UnpicklingError(
                f"serialized_named_tensors names {module}.{name}; only tensors may be sent "
                "(samebits.weights.ipc.serialize, or SGLang's MultiprocessingSerializer)"
            )
        return super().find_class(module, name)


def cuda_index(device: int | str) -> int:
    """A CUDA device index, or the index of the visible device with this UUID (SGLang's patched
    reductions name the device by `str(torch.cuda.get_device_properties(i).uuid)`, which holds
    across processes whose CUDA_VISIBLE_DEVICES differ). ValueError when no visible device has it."""
    if type(device) is int:
        return device
    if isinstance(device, str):
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == device:
                return i
        raise ValueError(f"serialized_named_tensors: no visible CUDA device has the UUID {device[:64]!r}")
    raise ValueError(
        f"serialized_named_tensors: a CUDA device is an index or a UUID, got {type(device).__name__}"
    )


def _rebuild_cuda_tensor_by_uuid(*args):
    """What SGLang's `_rebuild_cuda_tensor_modified` does: torch's `rebuild_cuda_tensor` with the
    device UUID turned back into this process's index."""
    args = (*args[:_DEVICE_ARG], cuda_index(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1 :])
    return torch_mp.reductions.rebuild_cuda_tensor(*args)


def _load(data: str | bytes, buckets: bool = False):
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
        unpickler = _Unpickler(io.BytesIO(raw))
        unpickler.buckets = buckets
        return unpickler.load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, TypeError, AttributeError) as e:
        raise ValueError(f"serialized_named_tensors: not a serialized tensor list: {e}") from e
    except RuntimeError as e:  # a handle that cannot be opened (another GPU, a freed tensor)
        raise ValueError(f"serialized_named_tensors: could not open the tensors: {e}") from e


def deserialize(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `serialize` -> [(name, tensor)] (CUDA tensors: views of the sender's
    memory). ValueError when the text is not such a pickle."""
    named = _load(data)
    if isinstance(named, dict):
        named = list(named.items())
    if not isinstance(named, list) or not all(
        isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in named
    ):
        raise ValueError("serialized_named_tensors: expected a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in named]


def deserialize_bucket(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """One `flattened_bucket` entry (SGLang's MultiprocessingSerializer of slime's bucket dict) ->
    [(name, tensor)], each a view of the bucket's bytes (CUDA: of the sender's memory). An empty
    bucket (slime sends one to a rank with nothing to load) is []. ValueError naming what is wrong:
    not a bucket, a range outside the bytes or not the shape's size, a misaligned tensor."""
    bucket = _load(data, buckets=True)
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        raise ValueError(
            "serialized_named_tensors: a flattened_bucket entry is a dict of 'flattened_tensor' and "
            "'metadata' (SGLang's FlattenedTensorBucket)"
        )
    flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("serialized_named_tensors: flattened_tensor must be a 1-D uint8 tensor")
    if not isinstance(metadata, list) or not all(isinstance(m, BucketEntry) for m in metadata):
        raise ValueError("serialized_named_tensors: metadata must be a list of FlattenedTensorMetadata")
    out = []
    for m in metadata:
        missing = [f.name for f in fields(BucketEntry) if f.name not in vars(m)]
        if missing:
            raise ValueError(f"serialized_named_tensors: bucket metadata lacks {missing}")
        if not isinstance(m.name, str):
            raise ValueError(
                f"serialized_named_tensors: a bucket entry's name is a {type(m.name).__name__}, not a str"
            )
        ints = (m.start_idx, m.end_idx, m.numel, *m.shape) if isinstance(m.shape, tuple | list) else None
        if (
            not isinstance(m.dtype, torch.dtype)
            or ints is None
            or not all(type(i) is int and 0 <= i < 2**63 for i in ints)
        ):
            raise ValueError(
                f"serialized_named_tensors: bucket entry {m.name[:200]!r}: needs a torch dtype (got a "
                f"{type(m.dtype).__name__}), and a shape and byte range of ints in [0, 2**63)"
            )
        size = math.prod(m.shape) * m.dtype.itemsize  # Python ints: no wrap-around
        if not (m.end_idx - m.start_idx == m.numel == size and m.end_idx <= flat.numel()):
            raise ValueError(
                f"serialized_named_tensors: bucket entry {m.name!r} (shape {list(m.shape)}, {m.dtype}) "
                f"takes bytes [{m.start_idx}, {m.end_idx}) of {flat.numel()}, numel {m.numel}: it needs "
                f"{size} bytes inside the bucket"
            )
        if m.start_idx % m.dtype.itemsize:
            raise ValueError(
                f"serialized_named_tensors: bucket entry {m.name!r} starts at byte {m.start_idx}, not a "
                f"multiple of {m.dtype}'s {m.dtype.itemsize} bytes"
            )
        try:
            out.append((m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)))
        except RuntimeError as e:  # a strided flattened_tensor, which SGLang's torch.cat never makes
            raise ValueError(f"serialized_named_tensors: bucket entry {m.name!r}: {e}") from e
    return out
