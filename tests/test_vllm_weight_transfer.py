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


def test_a_float32_after_three_bfloat16_unpacks_by_copy():
    # no padding between tensors: byte 6 is not a float32 boundary, which torch cannot view
    b, f = torch.tensor([1.0, 2.0, 3.0], dtype=BF16), torch.tensor([0.5, -4.0], dtype=F32)
    raw = b.view(torch.int16).numpy().tobytes() + f.numpy().tobytes()
    bucket = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = dict(vt.unpack(bucket, ["b", "f"], [[3], [2]], [BF16, F32]))
    assert torch.equal(out["b"], b) and torch.equal(out["f"], f)


# -- the NCCL binding, as far as it can be checked without libnccl ------------------------


def test_nccl_signatures_are_nccl_hs():
    from samebits.weights import nccl

    c = ctypes
    ptr_comm = c.POINTER(nccl.ncclComm_t)
    assert nccl.SIGNATURES["ncclCommInitRank"] == (c.c_int, [ptr_comm, c.c_int, vt.NcclUniqueId, c.c_int])
    collective = [c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_void_p, c.c_void_p]
    assert nccl.SIGNATURES["ncclBroadcast"] == (c.c_int, collective)  # ..., int root, comm, stream
    assert nccl.SIGNATURES["ncclAllReduce"] == (c.c_int, collective)  # ..., ncclRedOp_t op, comm, stream
    assert nccl.SIGNATURES["ncclGetErrorString"] == (c.c_char_p, [c.c_int])
    assert c.sizeof(vt.NcclUniqueId) == 128  # passed by value to ncclCommInitRank
    # nccl.h's ncclDataType_t: ncclUint8 1, ncclFloat32 7, ncclBfloat16 9; ncclSum 0
    assert (nccl.DTYPES[torch.uint8], nccl.DTYPES[F32], nccl.DTYPES[BF16], nccl.NCCL_SUM) == (1, 7, 9, 0)

    class FakeLib:  # a stand-in with every symbol, to see `declare` set each one
        def __init__(self):
            for name in nccl.SIGNATURES:
                setattr(self, name, types.SimpleNamespace())

    lib = nccl.declare(FakeLib())
    for name, (restype, argtypes) in nccl.SIGNATURES.items():
        assert getattr(lib, name).restype is restype and getattr(lib, name).argtypes == argtypes


def test_nccl_errors_carry_ncclGetErrorString():  # noqa: N802 - NCCL's name
    from samebits.weights import nccl

    lib = types.SimpleNamespace(ncclGetErrorString=lambda r: b"unhandled system error")
    nccl.check(lib, "ncclBroadcast", 0)  # ncclSuccess: nothing raised
    with pytest.raises(
        nccl.NcclError, match=r"ncclBroadcast failed: unhandled system error \(ncclResult_t 2\)"
    ):
        nccl.check(lib, "ncclBroadcast", 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU machine's")
def test_nccl_on_a_cpu_machine_is_refused_naming_cuda():
    from samebits.weights import nccl

    with pytest.raises(RuntimeError, match="CUDA"):
        nccl.load()


@pytest.mark.gpu
def test_gpu_a_one_rank_communicator_broadcasts_to_itself():
    from samebits.weights import nccl

    assert nccl.version() >= 2_00_00  # e.g. 22105 for 2.21.5
    device = torch.device("cuda", torch.cuda.current_device())
    comm = nccl.Communicator(nccl.unique_id(), 1, 0, device)  # the warm-up all-reduce ran inside
    try:
        x = torch.arange(1000, dtype=BF16, device=device)
        sent = x.clone()
        comm.broadcast(x, src=0)
        comm.synchronize(60)
        assert torch.equal(x, sent)
        y = torch.full((3,), 2.5, dtype=F32, device=device)
        comm.all_reduce(y)  # one rank: the sum is itself
        comm.synchronize(60)
        assert torch.equal(y.cpu(), torch.full((3,), 2.5))
        with pytest.raises(nccl.NcclError, match="ncclBroadcast failed"):
            comm.broadcast(x, src=5)  # control: a root outside the communicator is NCCL's error
    finally:
        comm.destroy()


# -- receive and apply in the engine's loop, the communicator a test double -------------


class InProcessTransport:
    """TEST DOUBLE for the NCCL communicator (not NCCL): `broadcast` fills the receiver's buffer
    with the next tensor the fake trainer below "sent", in-process. A buffer of another byte
    count is refused (real NCCL would hang or corrupt instead)."""

    def __init__(self, sent: list[torch.Tensor], fail_at: int | None = None):
        self.sent, self.fail_at, self.calls, self.aborted = list(sent), fail_at, 0, False

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("peer closed the connection")
        data = self.sent.pop(0).contiguous().view(-1).view(torch.uint8)
        out = tensor.view(-1).view(torch.uint8)
        assert src == 0 and data.numel() == out.numel(), (data.numel(), out.numel())
        out.copy_(data)

    def synchronize(self, timeout_s: float) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True


def vllm_pack(tensors: list[torch.Tensor], buffer_bytes: int) -> list[torch.Tensor]:
    """The trainer's buckets as vLLM's pack_tensors cuts them (its loop, restated): append the
    tensor's bytes, and close the bucket once the total exceeds buffer_bytes."""
    buckets, current, total = [], [], 0
    for t in tensors:
        flat = t.contiguous().view(torch.uint8).view(-1)
        current.append(flat)
        total += flat.numel()
        if total > buffer_bytes:
            buckets.append(torch.cat(current))
            current, total = [], 0
    if current:
        buckets.append(torch.cat(current))
    return buckets


class _Pipe:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


@pytest.fixture
def loop(tiny):
    from samebits import LLM
    from samebits.engine.engine_child import _Loop

    return _Loop(_Pipe(), LLM(tiny, max_num_seqs=2, max_model_len=64))


def _call(loop, method: str, **kwargs):
    """One engine call through the loop, as EngineProcess sends it -> (ok, value)."""
    call_id = len(loop.conn.sent) + 1000
    loop._handle(("call", call_id, method, kwargs))
    loop._run_calls_if_idle()
    [(_, ok, value)] = [m[1:] for m in loop.conn.sent if m[0] == "result" and m[1] == call_id]
    return ok, value


def _new_weights(llm, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    specs = llm.weight_store.param_specs()
    return {
        n: (torch.randn(s, generator=g) * 0.02).to(d) for n, (s, d) in specs.items() if n != "lm_head.weight"
    }


def _update_info(new: dict[str, torch.Tensor]) -> dict:
    return {
        "names": list(new),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in new.values()],
        "shapes": [list(t.shape) for t in new.values()],
    }


def _attach(loop, sent, packed: bool, buffer_bytes: int = 64 * 1024, **kw) -> InProcessTransport:
    from samebits.weights.vllm_receiver import Transfer

    transport = InProcessTransport(sent, **kw)
    loop.vllm.attach(Transfer(transport, torch.device("cpu"), packed=packed, buffer_bytes=buffer_bytes))
    return transport


@pytest.mark.parametrize("packed", [True, False])
def test_received_weights_equal_the_sent_ones_by_digest_after_finish_only(loop, packed):
    from samebits.engine.digest import tensor_digest

    llm = loop.llm
    new = _new_weights(llm, seed=1)
    before = llm.weight_digests()
    sent = vllm_pack(list(new.values()), 64 * 1024) if packed else list(new.values())
    assert not packed or len(sent) > 3  # several buckets
    transport = _attach(loop, sent, packed)
    assert _call(loop, "start_weight_update") == (True, "weight update started")
    ok, value = _call(loop, "receive_weights", update_info=_update_info(new))
    assert ok and f"received {len(new)} tensors" in value and not transport.sent
    assert llm.weight_digests() == before  # staged: nothing applied before finish
    ok, value = _call(loop, "finish_weight_update", weight_version="step-1")
    assert ok and f"applied {len(new)} tensors" in value and loop.weight_version == "step-1"
    after = llm.weight_digests()
    assert all(after[n] == tensor_digest(t) for n, t in new.items())
    assert after["lm_head.weight"] == before["lm_head.weight"]  # not sent, not changed


def test_one_changed_byte_in_a_bucket_gives_another_digest(loop):
    from samebits.engine.digest import tensor_digest

    new = _new_weights(loop.llm, seed=2)
    buckets = vllm_pack(list(new.values()), 64 * 1024)
    buckets[1][7] ^= 1  # control: one bit of one tensor of bucket 2 flipped in transit
    _attach(loop, buckets, packed=True)
    _call(loop, "start_weight_update")
    assert _call(loop, "receive_weights", update_info=_update_info(new))[0]
    assert _call(loop, "finish_weight_update")[0]
    after = loop.llm.weight_digests()
    differ = [n for n, t in new.items() if after[n] != tensor_digest(t)]
    assert len(differ) == 1


def test_a_nan_in_one_update_applies_nothing_of_the_bracket(loop):
    llm = loop.llm
    first, second = _new_weights(llm, seed=3), _new_weights(llm, seed=4)
    first = dict(list(first.items())[:5])
    second = dict(list(second.items())[5:8])
    second[next(iter(second))].view(-1)[0] = float("nan")
    before = llm.weight_digests()
    sent = vllm_pack(list(first.values()), 2**30) + vllm_pack(list(second.values()), 2**30)
    _attach(loop, sent, packed=True, buffer_bytes=2**30)
    _call(loop, "start_weight_update")
    assert _call(loop, "receive_weights", update_info=_update_info(first))[0]
    assert _call(loop, "receive_weights", update_info=_update_info(second))[0]
    ok, (kind, message) = _call(loop, "finish_weight_update", weight_version="bad")
    assert not ok and "nan" in message.lower() and next(iter(second)) in message
    assert llm.weight_digests() == before and loop.weight_version == "default"
    assert _call(loop, "finish_weight_update")[1][1].startswith("finish_weight_update: no update is open")


@pytest.mark.parametrize(
    "edit,expect",
    [
        (lambda u: u["names"].pop(), "one entry per tensor, got 2, 3 and 3"),  # a name missing
        (lambda u: u["names"].__setitem__(0, "model.nope.weight"), "unknown parameter 'model.nope.weight'"),
        (lambda u: u["shapes"].__setitem__(1, [3, 3]), "has shape (3, 3), expected"),
        (
            lambda u: u["dtype_names"].__setitem__(2, "float32"),
            "has dtype torch.float32, expected torch.bfloat16",
        ),
        (lambda u: u["dtype_names"].__setitem__(2, "bf16"), "dtype_names[2]: 'bf16' is not a torch dtype"),
    ],
)
def test_a_bad_declaration_is_refused_before_anything_is_received(loop, edit, expect):
    new = dict(list(_new_weights(loop.llm, seed=5).items())[:3])
    transport = _attach(loop, vllm_pack(list(new.values()), 2**30), packed=True, buffer_bytes=2**30)
    before = loop.llm.weight_digests()
    info = _update_info(new)
    edit(info)
    _call(loop, "start_weight_update")
    ok, (kind, message) = _call(loop, "receive_weights", update_info=info)
    assert not ok and expect in message and transport.calls == 0
    ok, value = _call(loop, "finish_weight_update")
    assert ok and value.startswith("applied 0 tensors")
    assert loop.llm.weight_digests() == before


def test_a_transport_that_fails_halfway_drops_the_update_and_applies_nothing(loop):
    new = _new_weights(loop.llm, seed=6)
    transport = _attach(loop, vllm_pack(list(new.values()), 64 * 1024), packed=True, fail_at=2)
    before = loop.llm.weight_digests()
    _call(loop, "start_weight_update")
    ok, (kind, message) = _call(loop, "receive_weights", update_info=_update_info(new))
    assert not ok and kind == "ConnectionError" and "bucket 2 of" in message and "peer closed" in message
    assert transport.aborted and loop.vllm.transfer is None
    assert loop.llm.weight_digests() == before
    ok, (_, message) = _call(loop, "finish_weight_update")
    assert not ok and "no update is open" in message


def test_finish_closes_its_update_on_arrival_and_applies_once_idle(loop):
    """A finish waits for the request in flight; the update it applies is the one open when it
    arrived, not one started after it."""
    from samebits import SamplingParams
    from samebits.engine.digest import tensor_digest

    new = dict(list(_new_weights(loop.llm, seed=7).items())[:4])
    _attach(loop, vllm_pack(list(new.values()), 2**30), packed=True, buffer_bytes=2**30)
    _call(loop, "start_weight_update")
    assert _call(loop, "receive_weights", update_info=_update_info(new))[0]
    loop._handle(("add", "r", [3, 4, 5], SamplingParams(max_tokens=4, seed=1, ignore_eos=True)))
    loop._handle(("call", 1, "finish_weight_update", {}))  # queued behind the request
    assert loop.calls and loop.vllm.staged is None  # closed on arrival
    assert _call(loop, "start_weight_update")[0]  # a new update may open meanwhile
    while loop.core.has_unfinished():
        loop._publish(loop._step())
    loop._run_calls_if_idle()
    [(ok, value)] = [m[2:] for m in loop.conn.sent if m[0] == "result" and m[1] == 1]
    assert ok and "applied 4 tensors" in value and "1 requests in flight finished on the old weights" in value
    after = loop.llm.weight_digests()
    assert all(after[n] == tensor_digest(t) for n, t in new.items())
    assert loop.vllm.staged == {}  # the later update, still open and empty


def test_bracket_errors(loop):
    new = dict(list(_new_weights(loop.llm, seed=8).items())[:2])
    ok, (_, message) = _call(loop, "receive_weights", update_info=_update_info(new))
    assert not ok and "no update is open; POST /start_weight_update first" in message
    ok, (_, message) = _call(loop, "finish_weight_update")
    assert not ok and "no update is open" in message
    assert _call(loop, "start_weight_update")[0]
    ok, (_, message) = _call(loop, "start_weight_update")
    assert not ok and "already open" in message
    ok, (_, message) = _call(loop, "receive_weights", update_info=_update_info(new))
    assert not ok and "POST /init_weight_transfer_engine first" in message  # no communicator
    ok, (_, message) = _call(loop, "init_transfer_engine", init_info={})
    assert not ok and "CUDA" in message


# -- the four endpoints over HTTP, on a CPU engine ----------------------------------------


@pytest.fixture(scope="module")
def server(tiny):
    from serve_server import Server

    srv = Server(tiny, "--max-num-seqs", "2", "--max-model-len", "64")
    yield srv
    srv.stop()


def _post(server, path: str, body=None):
    import httpx

    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _digests(server) -> dict:
    return _post(server, "/weight_digests", {})


TRL_INIT = {"master_address": "127.0.0.1", "master_port": 51216, "rank_offset": 1, "world_size": 2}


def test_http_a_cpu_engine_refuses_init_naming_cuda_and_offers_sglangs(server):
    import httpx

    config = httpx.get(f"{server.url}/server_info", params={"config_format": "json"}, timeout=60).json()
    assert config["vllm_config"]["weight_transfer_config"]["backend"] == "sglang"  # not nccl on a CPU
    r = _post(server, "/init_weight_transfer_engine", {"init_info": TRL_INIT | {"packed": True}})
    assert r.status_code == 400 and "CUDA" in r.json()["error"]["message"]
    r = _post(server, "/init_weight_transfer_engine", {"init_info": TRL_INIT | {"pakced": True}})
    assert r.status_code == 400 and "init_info.pakced" in r.json()["error"]["message"]  # a misspelt field


def test_http_bracket_and_declaration_errors_change_nothing(server):
    before = _digests(server).json()["digests"]
    info = {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[96]]}
    r = _post(server, "/update_weights", {"update_info": info})
    assert r.status_code == 400 and "no update is open; POST /start_weight_update first" in r.text
    r = _post(server, "/finish_weight_update", {})
    assert r.status_code == 400 and "no update is open" in r.text
    r = _post(server, "/start_weight_update", {"is_checkpoint_format": False})
    assert r.status_code == 400 and "is_checkpoint_format" in r.text
    r = _post(server, "/start_weight_update", {})
    assert r.status_code == 200 and r.json()["message"] == "Weight update started"
    assert _post(server, "/start_weight_update", {}).status_code == 400  # already open
    for edit, expect in [
        ({"names": ["model.nope"]}, "unknown parameter 'model.nope'"),
        ({"shapes": [[95]]}, "model.norm.weight has shape (95,), expected (96,)"),
        ({"dtype_names": ["float16"]}, "model.norm.weight has dtype torch.float16"),
        ({"shapes": []}, "one entry per tensor, got 1, 1 and 0"),
    ]:
        r = _post(server, "/update_weights", {"update_info": info | edit})
        assert r.status_code == 400 and expect in r.json()["error"]["message"], r.text
    r = _post(server, "/update_weights", {"update_info": info})  # well declared: no communicator
    assert r.status_code == 400 and "POST /init_weight_transfer_engine first" in r.text
    r = _post(server, "/finish_weight_update", {})
    assert r.status_code == 200 and r.json()["message"] == "Weight update finished"
    assert r.json()["detail"].startswith("applied 0 tensors")
    assert _digests(server).json()["digests"] == before
    assert _post(server, "/finish_weight_update").status_code == 400  # closed: no update open


def test_server_info_says_nccl_only_for_an_engine_on_cuda():
    from samebits.serve.vllm_api import vllm_config

    def engine(device):  # what vllm_config reads of an EngineProcess
        return types.SimpleNamespace(call=None, device=device, path="m", max_model_len=64)

    assert vllm_config(engine("cuda:0"), "m", {})["weight_transfer_config"] == {"backend": "nccl"}
    assert vllm_config(engine("cpu"), "m", {})["weight_transfer_config"]["backend"] == "sglang"
    in_process = types.SimpleNamespace(path="m", max_model_len=64)  # no engine process: no weight sync
    assert vllm_config(in_process, "m", {})["weight_transfer_config"] is None
