"""vLLM's NCCL weight-transfer protocol, the parts that run on one CPU (samebits.weights.vllm_transfer).

Byte layouts and store keys are stated here from vLLM's source (vllm-project/vllm,
`backends/distributed/weight_transfer/packed_tensor.py` at 00a9ccfb, `nccl_common.py` at
055e47c2, `distributed/utils.py` StatelessProcessGroup), not from samebits' own packer: there
is none. The NCCL data plane is not tested (no NCCL on CPU; two ranks need two GPUs).
"""

from __future__ import annotations

import ctypes
import pickle
import sys
import types
from datetime import timedelta

import pytest
import torch

from samebits.weights import vllm_transfer as vt

F32, BF16 = torch.float32, torch.bfloat16


def test_bucket_closes_once_it_exceeds_the_buffer_including_the_crossing_tensor():
    # vLLM's pack_tensors: append, add the bytes, break if total > buffer_size_bytes
    shapes, dtypes = [[4], [4], [2], [8]], [F32, F32, BF16, F32]  # 16, 16, 4, 32 bytes
    assert vt.bucket_plan(shapes, dtypes, 20) == [[0, 1], [2, 3]]  # 32 > 20; then 4, 36 > 20
    assert vt.bucket_plan(shapes, dtypes, 32) == [[0, 1, 2], [3]]  # 32 is not > 32: tensor 2 joins
    assert vt.bucket_plan(shapes, dtypes, 2**30) == [[0, 1, 2, 3]]


def test_hand_built_bucket_unpacks_at_known_offsets():
    a = torch.tensor([[1.5, -2.0], [3.0, 0.25]], dtype=F32)  # bytes 0..15
    b = torch.tensor([7.0, -1.0, 0.5], dtype=BF16)  # bytes 16..21, no padding
    raw = a.numpy().tobytes() + b.view(torch.int16).numpy().tobytes()
    bucket = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = dict(vt.unpack(bucket, ["a", "b"], [[2, 2], [3]], [F32, BF16]))
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)
    # control: a declaration that does not cover the bucket's bytes is refused
    with pytest.raises(ValueError, match="expected 6 uint8 bytes"):
        vt.unpack(bucket, ["b"], [[3]], [BF16])
    # control: the declared dtype decides the reading; bf16 for `a` gives other values
    misread = dict(vt.unpack(bucket, ["a", "b"], [[8], [3]], [BF16, BF16]))
    assert not torch.equal(misread["a"].float()[:4], a.flatten())
    assert torch.equal(misread["b"], b)


def _vllm_pickled_unique_id(raw: bytes, monkeypatch) -> bytes:
    # vLLM pickles its own ctypes class; a module of that name stands in only while dumping
    name = "vllm.distributed.device_communicators.pynccl_wrapper"
    mod = types.ModuleType(name)

    class ncclUniqueId(ctypes.Structure):  # noqa: N801 - vLLM's name, as it appears in the pickle
        _fields_ = [("internal", ctypes.c_byte * 128)]

    ncclUniqueId.__module__ = name
    ncclUniqueId.__qualname__ = "ncclUniqueId"
    mod.ncclUniqueId = ncclUniqueId
    with monkeypatch.context() as mp:
        for parent in ("vllm", "vllm.distributed", "vllm.distributed.device_communicators"):
            mp.setitem(sys.modules, parent, types.ModuleType(parent))
        mp.setitem(sys.modules, name, mod)
        uid = ncclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), raw, 128)
        return pickle.dumps(uid)


def test_rendezvous_and_unique_id_from_a_fake_trainer_rank(monkeypatch):
    raw = bytes(range(128))
    # rank 0 (the trainer) hosts the store; port 0: a free one. vLLM's rank 0 blocks until all
    # ranks joined (wait_for_workers); not waiting here changes no key.
    master = torch.distributed.TCPStore(
        "127.0.0.1",
        0,
        2,
        is_master=True,
        timeout=timedelta(seconds=30),
        wait_for_workers=False,
        use_libuv=False,
    )
    master.set("broadcast_from/0/0", _vllm_pickled_unique_id(raw, monkeypatch))
    store = vt.join_store("127.0.0.1", master.port, rank=1, world_size=2, timeout_s=30)
    assert vt.receive_unique_id(store) == raw
    # control: a pickle naming any other class is refused, not run
    master.set("broadcast_from/0/0", pickle.dumps(types.SimpleNamespace(internal=raw)))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        vt.receive_unique_id(store)


def test_rank_zero_is_the_trainers():
    with pytest.raises(ValueError, match="rank_offset"):
        vt.join_store("127.0.0.1", 1, rank=0, world_size=2)


def test_cpu_engine_is_refused_naming_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        vt.require_cuda(torch.device("cpu"))
