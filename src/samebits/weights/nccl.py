"""A minimal ctypes binding of libnccl: what the receiving half of vLLM's weight transfer needs.

vLLM's PyNcclCommunicator (`device_communicators/pynccl.py`) binds libnccl by ctypes too; this
binds the same functions with nccl.h's signatures and nothing else:

    ncclResult_t ncclGetVersion(int* version);
    ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
    ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
    ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream);
    ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                               ncclDataType_t datatype, int root, ncclComm_t comm,
                               cudaStream_t stream);
    ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
    ncclResult_t ncclCommAbort(ncclComm_t comm);
    ncclResult_t ncclCommDestroy(ncclComm_t comm);
    const char*  ncclGetErrorString(ncclResult_t result);

`ncclUniqueId` is passed by value (a 128-byte struct). The library is found as torch finds it:
the `nvidia-nccl` wheel's `nvidia/nccl/lib/libnccl.so.2`, else the soname `libnccl.so.2` (torch
has loaded it in a CUDA build), else `ctypes.util.find_library("nccl")`; `SAMEBITS_NCCL_SO`
names a file instead. NCCL runs on CUDA only: on a CPU-only machine `load` raises naming CUDA.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import os
import time
from pathlib import Path

import torch

from samebits.weights.vllm_transfer import NcclUniqueId

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
buffer_t = ctypes.c_void_p

# nccl.h's ncclDataType_t and ncclRedOp_t values
DTYPES = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
NCCL_SUM = 0
IN_PROGRESS = 7  # ncclInProgress: a non-blocking communicator's pending state

# name -> (restype, argtypes), exactly nccl.h's
SIGNATURES = {
    "ncclGetVersion": (ncclResult_t, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetUniqueId": (ncclResult_t, [ctypes.POINTER(NcclUniqueId)]),
    "ncclCommInitRank": (ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, NcclUniqueId, ctypes.c_int]),
    "ncclAllReduce": (
        ncclResult_t,
        [buffer_t, buffer_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ncclComm_t, cudaStream_t],
    ),
    "ncclBroadcast": (
        ncclResult_t,
        [buffer_t, buffer_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ncclComm_t, cudaStream_t],
    ),
    "ncclCommGetAsyncError": (ncclResult_t, [ncclComm_t, ctypes.POINTER(ncclResult_t)]),
    "ncclCommAbort": (ncclResult_t, [ncclComm_t]),
    "ncclCommDestroy": (ncclResult_t, [ncclComm_t]),
    "ncclGetErrorString": (ctypes.c_char_p, [ncclResult_t]),
}


class NcclError(RuntimeError):
    """A libnccl call that did not return ncclSuccess, named with NCCL's own error string."""


def candidates() -> list[str]:
    """Where libnccl is looked for, in order."""
    found = []
    if os.environ.get("SAMEBITS_NCCL_SO"):
        found.append(os.environ["SAMEBITS_NCCL_SO"])
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for root in (spec.submodule_search_locations or []) if spec else []:
        found.append(str(Path(root) / "lib" / "libnccl.so.2"))
    found.append("libnccl.so.2")
    if name := ctypes.util.find_library("nccl"):
        found.append(name)
    return found


@functools.cache
def load() -> ctypes.CDLL:
    """libnccl with SIGNATURES declared. RuntimeError naming CUDA where there is none, or
    OSError listing where it looked."""
    if not torch.cuda.is_available():
        raise RuntimeError("NCCL runs on CUDA only, and no CUDA device is available to this process")
    tried = []
    for path in candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path}: {e}")
            continue
        return declare(lib)
    raise OSError("libnccl not found; tried " + "; ".join(tried) + " (set SAMEBITS_NCCL_SO to its path)")


def declare(lib):
    """Set each function's restype and argtypes from SIGNATURES -> lib."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def check(lib, name: str, result: int) -> None:
    if result != 0:
        text = lib.ncclGetErrorString(result).decode(errors="replace")
        raise NcclError(f"{name} failed: {text} (ncclResult_t {result})")


def version() -> int:
    """NCCL's version code (e.g. 22105 for 2.21.5)."""
    lib, v = load(), ctypes.c_int()
    check(lib, "ncclGetVersion", lib.ncclGetVersion(ctypes.byref(v)))
    return v.value


def unique_id() -> bytes:
    """A fresh ncclUniqueId (what rank 0 creates and shares) -> its 128 bytes."""
    lib, uid = load(), NcclUniqueId()
    check(lib, "ncclGetUniqueId", lib.ncclGetUniqueId(ctypes.byref(uid)))
    return bytes(uid.internal)


class Communicator:
    """One rank of an NCCL communicator on one CUDA device, built as vLLM's PyNcclCommunicator
    builds it: ncclCommInitRank (blocks until all `world_size` ranks called it), then an
    all-reduce (sum) of one float32 zero, which every rank runs, then a stream sync."""

    def __init__(self, uid: bytes, world_size: int, rank: int, device: torch.device):
        self.lib, self.device = load(), torch.device(device)
        nccl_id = NcclUniqueId()
        ctypes.memmove(ctypes.addressof(nccl_id), bytes(uid), ctypes.sizeof(nccl_id))
        self.comm = ncclComm_t()
        with torch.cuda.device(self.device):  # NCCL binds the calling thread's current device
            result = self.lib.ncclCommInitRank(ctypes.byref(self.comm), world_size, nccl_id, rank)
            check(self.lib, "ncclCommInitRank", result)
            warm = torch.zeros(1, dtype=torch.float32, device=self.device)
            self.all_reduce(warm)
            torch.cuda.current_stream(self.device).synchronize()

    def _stream(self, stream) -> cudaStream_t:
        return cudaStream_t((stream or torch.cuda.current_stream(self.device)).cuda_stream)

    def all_reduce(self, tensor: torch.Tensor, stream=None) -> None:
        """In place, sum over the ranks (enqueued on `stream`, default the current one)."""
        ptr = buffer_t(tensor.data_ptr())
        with torch.cuda.device(self.device):
            result = self.lib.ncclAllReduce(
                ptr, ptr, tensor.numel(), _dtype(tensor), NCCL_SUM, self.comm, self._stream(stream)
            )
        check(self.lib, "ncclAllReduce", result)

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        """Fill `tensor` (contiguous, on this device) with rank `src`'s; on `src` it is sent.
        Enqueued on `stream` (default the current one): see `synchronize`."""
        if not tensor.is_contiguous() or tensor.device != self.device:
            raise ValueError(f"broadcast: the tensor must be contiguous on {self.device}")
        recv = buffer_t(tensor.data_ptr())  # in place on `src` (nccl.h allows it); ignored elsewhere
        with torch.cuda.device(self.device):
            result = self.lib.ncclBroadcast(
                recv, recv, tensor.numel(), _dtype(tensor), src, self.comm, self._stream(stream)
            )
        check(self.lib, "ncclBroadcast", result)

    def synchronize(self, timeout_s: float, stream=None) -> None:
        """Wait for the work enqueued on `stream`; NcclError (and the communicator aborted) when
        NCCL reports an asynchronous error (a peer that went away) or after `timeout_s`."""
        done = torch.cuda.Event()
        done.record(stream or torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + timeout_s
        while not done.query():
            err = ncclResult_t()
            check(
                self.lib, "ncclCommGetAsyncError", self.lib.ncclCommGetAsyncError(self.comm, ctypes.byref(err))
            )
            if err.value not in (0, IN_PROGRESS):
                self.abort()
                check(self.lib, "NCCL (asynchronous)", err.value)
            if time.monotonic() > deadline:
                self.abort()
                raise NcclError(
                    f"NCCL: the transfer did not complete within {timeout_s:.0f} s; communicator aborted"
                )
            time.sleep(0.001)

    def abort(self) -> None:
        """Tear down at once, pending work included (after an error)."""
        if self.comm:
            self.lib.ncclCommAbort(self.comm)
            self.comm = ncclComm_t()

    def destroy(self) -> None:
        """Tear down (no work pending)."""
        if self.comm:
            comm, self.comm = self.comm, ncclComm_t()
            check(self.lib, "ncclCommDestroy", self.lib.ncclCommDestroy(comm))


def _dtype(tensor: torch.Tensor) -> int:
    if tensor.dtype not in DTYPES:
        raise ValueError(f"NCCL: no ncclDataType_t for {tensor.dtype}")
    return DTYPES[tensor.dtype]
