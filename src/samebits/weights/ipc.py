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
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp
import torch.multiprocessing.reductions  # noqa: F401 - registers the tensor reductions

_REBUILDERS = "torch.multiprocessing.reductions"
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


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = (module, name) in _ALLOWED or (module == _REBUILDERS and name.startswith("rebuild_"))
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(
                f"serialized_named_tensors names {module}.{name}; only tensors may be sent "
                "(samebits.weights.ipc.serialize, or SGLang's MultiprocessingSerializer)"
            )
        return super().find_class(module, name)


def deserialize(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `serialize` -> [(name, tensor)] (CUDA tensors: views of the sender's
    memory). ValueError when the text is not such a pickle."""
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
        named = _Unpickler(io.BytesIO(raw)).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, TypeError, AttributeError) as e:
        raise ValueError(f"serialized_named_tensors: not a serialized tensor list: {e}") from e
    except RuntimeError as e:  # a handle that cannot be opened (another GPU, a freed tensor)
        raise ValueError(f"serialized_named_tensors: could not open the tensors: {e}") from e
    if isinstance(named, dict):
        named = list(named.items())
    if not isinstance(named, list) or not all(
        isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in named
    ):
        raise ValueError("serialized_named_tensors: expected a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in named]
