"""Weights from another process into `samebits serve`, over loopback (SGLang's protocol).

The trainer here is the test process (or a child process where it must die halfway): a
transformers model with fp32 master weights, one AdamW step under `batch_invariant()`, all
parameters pushed through the weight-update group (gloo) as bf16. Claims:
- the server's digests equal the trainer's, tensor by tensor;
- new completions at T = 0.7, 1.0, 1.3 are `torch.equal` to the trainer's own line,
  `torch.log_softmax(logits.float() / T, dim=-1)`, on the pushed weights;
  control: the same completions from before the push do not match the new weights;
- a bad update (unknown name, wrong shape or dtype, NaN, a trainer that dies halfway) is
  refused naming the tensor, and the old weights keep serving, bitwise;
- requests in flight finish on the old weights.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from serve_server import Server

from samebits import batch_invariant, trainer
from samebits.client import Client, WeightSyncError

TEMPS = (0.7, 1.0, 1.3)
PROMPT = [5, 9, 11, 3, 7, 2, 8]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny):
    srv = Server(tiny, "--max-num-seqs", "4", "--max-model-len", "256")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = Client(server.url, timeout=120)
    c.init_weights_update_group("127.0.0.1", _free_port(), backend="gloo")
    yield c
    for name in list(c.groups):
        c.destroy_weights_update_group(name)


def _completions(client: Client, max_tokens: int = 10) -> list[tuple[list[int], torch.Tensor]]:
    outs = []
    for i, t in enumerate(TEMPS):
        sp = {"temperature": t, "max_new_tokens": max_tokens, "ignore_eos": True, "sampling_seed": 11 + i}
        meta = client.generate(PROMPT, sp)
        lps = torch.tensor([x[0] for x in meta["meta_info"]["output_token_logprobs"]], dtype=torch.float32)
        outs.append((meta["output_ids"], lps))
    return outs


def _trainer_line(model, completions) -> list[torch.Tensor]:
    """What the trainer computes for each completion: its own one line, no samebits helper."""
    out = []
    for (ids, _), t in zip(completions, TEMPS, strict=True):
        seq = torch.tensor(PROMPT + ids)
        with batch_invariant(), torch.no_grad():
            logits = model(input_ids=seq[None], use_cache=False).logits[0]
            lp = torch.log_softmax(logits[len(PROMPT) - 1 : -1].float() / t, dim=-1)
        out.append(lp.gather(-1, seq[len(PROMPT) :, None])[:, 0])
    return out


def _trained(tiny) -> torch.nn.Module:
    """fp32 master weights after one AdamW step on a packed next-token loss."""
    model = trainer.load_hf_model(tiny, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([PROMPT + [4, 6, 10, 12]])
    with batch_invariant():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    return model.eval()


def _bf16_twin(tiny, master) -> torch.nn.Module:
    """The trainer's bf16 copy of its master weights (what it recomputes log-probs with)."""
    model = trainer.load_hf_model(tiny, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(dict(master.named_parameters())[name].to(torch.bfloat16))
    return model


def test_push_all_parameters_then_completions_equal_the_trainer_line(tiny, client):
    before = _completions(client)
    master = _trained(tiny)
    old = client.weight_digests()
    assert old != client.local_digests(master.named_parameters())  # the step changed every tensor
    msgs = client.update_weights_from_distributed(master.named_parameters())
    assert len(msgs) == 1 and "updated" in msgs[0]
    assert client.weight_digests() == client.local_digests(master.named_parameters())
    after = _completions(client)
    twin = _bf16_twin(tiny, master)
    for (_, lps), want in zip(after, _trainer_line(twin, after), strict=True):
        assert torch.equal(lps, want)
    # control: the completions from before the push do not fit the new weights
    stale = _trainer_line(twin, before)
    assert any(not torch.equal(lps, want) for (_, lps), want in zip(before, stale, strict=True))


def test_bucketed_push_and_ipc_push_give_the_same_digests(tiny, client):
    master = _trained(tiny)
    with torch.no_grad():
        for p in master.parameters():
            p.mul_(0.5)
    msgs = client.update_weights_from_distributed(master.named_parameters(), bucket_bytes=4096)
    assert len(msgs) > 3
    want = client.local_digests(master.named_parameters())
    assert client.weight_digests() == want
    with torch.no_grad():
        for p in master.parameters():
            p.mul_(2.0)
    assert "updated" in client.update_weights_from_tensor(master.named_parameters())
    assert client.weight_digests() == client.local_digests(master.named_parameters()) != want


@pytest.mark.parametrize(
    "bad, expect",
    [
        (lambda n, d, s: ([n[0] + ".nope"], d[:1], s[:1]), "unknown parameter"),
        (lambda n, d, s: (n[:1], d[:1], [[s[0][0] + 1, *s[0][1:]]]), "has shape"),
        (lambda n, d, s: (n[:1], ["float16"], s[:1]), "has dtype"),
        (lambda n, d, s: (n[:1], ["not_a_dtype"], s[:1]), "not a torch dtype"),
        (lambda n, d, s: (n[:2] + n[:1], d[:2] + d[:1], s[:2] + s[:1]), "more than once"),
    ],
    ids=["unknown-name", "shape", "dtype", "dtype-name", "duplicate"],
)
def test_a_bad_declaration_is_refused_at_once_and_nothing_changes(client, bad, expect):
    specs = client.weight_specs()
    names = list(specs)
    dtypes = [str(specs[n][1]).removeprefix("torch.") for n in names]
    shapes = [list(specs[n][0]) for n in names]
    before, outs = client.weight_digests(), _completions(client, 4)
    n, d, s = bad(names, dtypes, shapes)
    with pytest.raises(WeightSyncError, match=f"400.*{expect}") as err:  # no broadcast: it cannot wait on one
        client.post("/update_weights_from_distributed", {"names": n, "dtypes": d, "shapes": s})
    assert n[0].split(".")[0] in str(err.value) or expect == "not a torch dtype"
    assert client.weight_digests() == before
    assert all(torch.equal(a[1], b[1]) for a, b in zip(_completions(client, 4), outs, strict=True))


def test_a_nan_is_refused_and_the_old_weights_keep_serving(tiny, client):
    before, outs = client.weight_digests(), _completions(client, 4)
    master = _trained(tiny)
    name = "model.layers.0.self_attn.q_proj.weight"
    with torch.no_grad():
        dict(master.named_parameters())[name][3, 5] = float("nan")
    with pytest.raises(WeightSyncError, match=f"400.*{name}"):
        client.update_weights_from_distributed(master.named_parameters())
    assert client.weight_digests() == before
    assert all(torch.equal(a[1], b[1]) for a, b in zip(_completions(client, 4), outs, strict=True))


_DYING_TRAINER = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from samebits.client import Client, _Background
    url, port, model_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    c = Client(url, timeout=120)
    c.init_weights_update_group("127.0.0.1", port, backend="gloo", group_name="dying")
    pairs = list(c.weight_specs().items())[:5]
    body = {"names": [n for n, _ in pairs], "dtypes": [str(d).removeprefix("torch.") for _, (_, d) in pairs],
            "shapes": [list(s) for _, (s, _) in pairs], "group_name": "dying"}
    _Background(c.post, "/update_weights_from_distributed", body)
    pg = c.groups["dying"][0]
    for _, (shape, dtype) in pairs[:2]:
        dist.broadcast(torch.ones(shape, dtype=dtype), src=0, group=pg)
    print("sent 2", flush=True)
    os._exit(1)  # the connection breaks halfway through the update
    """
)


def test_a_trainer_that_dies_halfway_changes_nothing(tiny, client, server, tmp_path):
    before, outs = client.weight_digests(), _completions(client, 4)
    script = tmp_path / "dying.py"
    script.write_text(_DYING_TRAINER)
    proc = subprocess.run(
        [sys.executable, str(script), server.url, str(_free_port()), str(tiny)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert "sent 2" in proc.stdout, proc.stderr[-2000:]
    # the server answered the dead trainer's request with a 500; it names the third tensor
    digests = client.weight_digests()
    assert digests == before
    assert all(torch.equal(a[1], b[1]) for a, b in zip(_completions(client, 4), outs, strict=True))
    with pytest.raises(WeightSyncError, match="no group 'dying'|no weight update group"):
        client.post(
            "/update_weights_from_distributed",
            {"names": [], "dtypes": [], "shapes": [], "group_name": "dying"},
        )


def test_a_request_in_flight_finishes_on_the_old_weights(tiny, client, server):
    import httpx

    sp = {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True, "sampling_seed": 5}
    alone = client.generate(PROMPT, sp)  # the same request, with nothing else going on
    master = _trained(tiny)
    with torch.no_grad():
        for p in master.parameters():
            p.mul_(0.9)  # weights the server does not have yet
    answer = []
    with httpx.stream(
        "POST",
        f"{server.url}/generate",
        json={"input_ids": PROMPT, "sampling_params": sp, "stream": True, "return_logprob": True},
        timeout=120,
    ) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert first
        push = threading.Thread(
            target=lambda: answer.extend(client.update_weights_from_distributed(master.named_parameters()))
        )
        push.start()
        last = [line for line in lines if line.startswith("data:") and "[DONE]" not in line][-1]
    push.join(timeout=120)
    assert "1 requests in flight finished on the old weights first" in answer[0]
    streamed = json.loads(last[len("data:") :])
    assert streamed["output_ids"] == alone["output_ids"]
    assert streamed["meta_info"]["output_token_logprobs"] == alone["meta_info"]["output_token_logprobs"]
    assert client.generate(PROMPT, sp)["output_ids"] != alone["output_ids"]  # the update did land


def test_the_group_is_sglangs(tmp_path):
    """Both ends made with SGLang's recipe (PrefixStore(group_name) over the rendezvous store,
    a named non-default group): a broadcast crosses, and no default group is created."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    q = ctx.Queue()
    p = ctx.Process(target=_receive_one, args=(port, q))
    p.start()
    from samebits.weights.group import destroy, init_custom_process_group

    pg = init_custom_process_group("gloo", "127.0.0.1", port, 2, 0, "g")
    torch.distributed.broadcast(torch.arange(5.0), src=0, group=pg)
    assert q.get(timeout=60) == [0.0, 1.0, 2.0, 3.0, 4.0]
    p.join(timeout=60)
    assert not torch.distributed.is_initialized()
    destroy(pg)


def _receive_one(port, q) -> None:
    from samebits.weights.group import destroy, init_custom_process_group

    pg = init_custom_process_group("gloo", "127.0.0.1", port, 2, 1, "g")
    t = torch.empty(5)
    torch.distributed.broadcast(t, src=0, group=pg)
    q.put(t.tolist())
    destroy(pg)


def test_a_join_that_never_completes_does_not_stop_the_engine(client):
    """A trainer that asks the server to join but never joins itself (here: nobody hosts the
    store) must not freeze generation: the rendezvous waits in a thread of its own."""
    body = {
        "master_address": "127.0.0.1",
        "master_port": _free_port(),
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "never",
        "backend": "gloo",
    }
    threading.Thread(
        target=lambda: _swallow(client.post, "/init_weights_update_group", body), daemon=True
    ).start()
    before = _completions(client, 4)
    assert all(len(ids) == 4 for ids, _ in before)
    with pytest.raises(WeightSyncError, match="already exists"):  # the pending join holds its name
        client.post("/init_weights_update_group", body)


def _swallow(fn, *args) -> None:
    try:
        fn(*args)
    except WeightSyncError:
        pass


def test_disk_reload_release_and_resume_over_http(tiny, client):
    """/update_weights_from_disk restores the checkpoint's weights (digests = the files');
    released memory refuses requests; after a resume, requests wait for weights; the reload
    then gives the same completions bit for bit."""
    from samebits.model.qwen3_moe.loader import load_state_dict

    client.update_weights_from_disk(str(tiny))
    _, state = load_state_dict(tiny, dtype=torch.bfloat16)
    files = client.local_digests(state.items())
    assert client.weight_digests(list(files)) == files
    reloaded = _completions(client, 6)
    client.release_memory_occupation()
    with pytest.raises(WeightSyncError, match="released"):
        client.generate(PROMPT, {"max_new_tokens": 2})
    client.resume_memory_occupation()
    with pytest.raises(WeightSyncError, match="not loaded"):
        client.generate(PROMPT, {"max_new_tokens": 2})
    client.update_weights_from_disk(str(tiny))
    again = _completions(client, 6)
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(again, reloaded, strict=True))
    client.post("/flush_cache")
    with pytest.raises(WeightSyncError, match="400.*model_path|400.*does not exist|400.*not"):
        client.update_weights_from_disk(str(tiny) + "-missing")
    assert client.weight_digests(list(files)) == files


def _per_expert(params: dict, swap: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The parameters under the hub's per-expert names (`swap`: gate and up exchanged)."""
    pairs = []
    for n, p in params.items():
        prefix = n.rsplit(".", 1)[0]
        if n.endswith("mlp.experts.gate_up_proj"):
            half = p.shape[1] // 2
            gate, up = ("up", "gate") if swap else ("gate", "up")
            for e in range(p.shape[0]):
                pairs += [
                    (f"{prefix}.{e}.{gate}_proj.weight", p[e, :half]),
                    (f"{prefix}.{e}.{up}_proj.weight", p[e, half:]),
                ]
        elif n.endswith("mlp.experts.down_proj"):
            pairs += [(f"{prefix}.{e}.down_proj.weight", p[e]) for e in range(p.shape[0])]
        else:
            pairs.append((n, p))
    return pairs


def test_hub_per_expert_names_write_their_slices(tiny, client):
    master = _trained(tiny)
    with torch.no_grad():
        for p in master.parameters():
            p.mul_(0.8)
    params = dict(master.named_parameters())
    want = client.local_digests(params.items())
    client.update_weights_from_distributed(_per_expert(params, swap=True))  # control: gate <-> up
    assert client.weight_digests() != want
    pairs = _per_expert(params)
    assert any(".experts.3.up_proj.weight" in n for n, _ in pairs)
    client.update_weights_from_distributed(pairs, bucket_bytes=1 << 14)
    assert client.weight_digests() == want


def test_weight_version_follows_successful_updates_only(tiny, client):
    master = _trained(tiny)
    client.update_weights_from_distributed(
        master.named_parameters(), bucket_bytes=1 << 14, weight_version="step-7"
    )
    assert client.get_weight_version() == "step-7"
    assert client.generate(PROMPT, {"max_new_tokens": 2})["meta_info"]["weight_version"] == "step-7"
    with torch.no_grad():
        dict(master.named_parameters())["lm_head.weight"][0, 0] = float("inf")
    with pytest.raises(WeightSyncError, match="lm_head.weight"):
        client.update_weights_from_tensor(master.named_parameters(), weight_version="step-8")
    assert client.get_weight_version() == "step-7"  # a refused update does not move it


def test_a_pickle_that_is_not_tensors_is_refused_and_runs_nothing(client, tmp_path):
    """The IPC body is unpickled in the engine: anything but tensors is refused by name, so a
    request body cannot run code there (control: the same pickle loads with a plain unpickler)."""
    import base64
    import os
    import pickle

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = base64.b64encode(pickle.dumps([("x", Evil())])).decode()
    # protocol 4 names a dotted attribute path: an allowed module's function's builtins' eval
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()".encode()
    dotted = base64.b64encode(
        b"\x80\x04ctorch.multiprocessing.reductions\nrebuild_tensor.__builtins__.get\n(X\x04\x00\x00\x00evaltR"
        + b"(X" + len(code).to_bytes(4, "little") + code + b"tR."
    ).decode()  # fmt: skip
    before = client.weight_digests()
    with pytest.raises(WeightSyncError, match="400.*only tensors may be sent"):
        client.post("/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
    for load_format in (None, "flattened_bucket"):
        body = {"serialized_named_tensors": [dotted], "load_format": load_format}
        with pytest.raises(WeightSyncError, match="400.*rebuild_tensor.__builtins__.get; only tensors"):
            client.post("/update_weights_from_tensor", body)
    with pytest.raises(WeightSyncError, match="400.*not a serialized tensor list"):
        client.post("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]})
    with pytest.raises(WeightSyncError, match="400"):
        client.post("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [], "typo": 1})
    assert not marker.exists() and client.weight_digests() == before
    pickle.loads(base64.b64decode(evil))  # control: a plain unpickler runs it
    assert marker.exists()
    marker.unlink()
    pickle.loads(base64.b64decode(dotted))  # and the dotted one
    assert marker.exists()


def test_a_refused_join_answers_at_once_on_the_trainer_side(client):
    """The server refuses (the group name is taken): the trainer's call raises its message at
    once instead of waiting out the 30-minute rendezvous it started."""
    with pytest.raises(WeightSyncError, match="already exists"):
        client.init_weights_update_group("127.0.0.1", _free_port(), backend="gloo")


def _sglang_reductions(monkeypatch) -> None:
    """SGLang's `monkey_patch_torch_reductions` (slime's `hf_weight_iterator_direct` calls it
    before serializing), for this test's pickles: a CUDA tensor pickles as
    `sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified` with its device's UUID in place
    of the index (the receiver maps it back); CPU tensors are unchanged. The function is a stand-in
    under SGLang's path: the pickle names it, the server never calls it."""
    import types
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    path = "sglang.srt.utils.patch_torch"
    for name in ("sglang", "sglang.srt", "sglang.srt.utils", path):
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))

    def _rebuild_cuda_tensor_modified(*args):
        raise AssertionError("a stand-in: only its name travels")

    _rebuild_cuda_tensor_modified.__module__ = path
    _rebuild_cuda_tensor_modified.__qualname__ = "_rebuild_cuda_tensor_modified"  # pickled by this name
    sys.modules[path]._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified

    def reduce_tensor(tensor):
        rebuild, args = reductions.reduce_tensor(tensor)
        if rebuild is reductions.rebuild_cuda_tensor:
            uuid = str(torch.cuda.get_device_properties(args[6]).uuid)
            return _rebuild_cuda_tensor_modified, (*args[:6], uuid, *args[7:])
        return rebuild, args

    for cls in (torch.Tensor, torch.nn.Parameter):
        monkeypatch.setitem(ForkingPickler._extra_reducers, cls, reduce_tensor)


def _slime_bucket(pairs, monkeypatch, edit=None) -> tuple[str, torch.Tensor]:
    """slime's colocated payload, step by step as its released code builds it
    (`update_weight_from_tensor._build_flattened_tensor_data` at THUDM/slime 624b824: SGLang
    0.5.23's `FlattenedTensorBucket(named_tensors=...)`, then
    `MultiprocessingSerializer.serialize(..., output_str=True)`): each tensor's bytes
    (`flatten().view(torch.uint8)`) concatenated, one metadata object a tensor, a ForkingPickler
    dump in base64. SGLang does not install on CI (its wheel is 39 MB for CPython 3.11 with CUDA
    kernels), so its metadata class is a dataclass of the same name and fields under its module
    path. `edit(metadata)` changes the metadata before the dump. -> (payload, the bucket's bytes:
    kept alive until the server answered, as slime keeps its `long_live_tensors`)."""
    import base64
    import dataclasses
    import io
    import types
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as torch_mp

    path = "sglang.srt.weight_sync.tensor_bucket"
    cls = dataclasses.make_dataclass(
        "FlattenedTensorMetadata", ["name", "shape", "dtype", "start_idx", "end_idx", "numel"]
    )
    cls.__module__ = path
    for name in ("sglang", "sglang.srt", "sglang.srt.weight_sync", path):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[path].FlattenedTensorMetadata = cls
    flat, metadata, at = [], [], 0
    for name, tensor in pairs:
        flat.append(tensor.flatten().view(torch.uint8))
        metadata.append(cls(name, tensor.shape, tensor.dtype, at, at + flat[-1].numel(), flat[-1].numel()))
        at += flat[-1].numel()
    if edit:
        edit(metadata)
    _sglang_reductions(monkeypatch)
    torch_mp.set_sharing_strategy("file_system")  # CPU tensors over HTTP (SGLang's are CUDA IPC)
    buf = io.BytesIO()
    flattened = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    ForkingPickler(buf).dump({"flattened_tensor": flattened, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode(), flattened


def test_slimes_flattened_bucket_loads_every_tensor(tiny, client, monkeypatch):
    """`/update_weights_from_tensor` with `load_format: "flattened_bucket"`, as slime's colocated
    sync sends it: every parameter in one bucket; the server's digests then equal the trainer's
    and weight_version follows; slime's empty bucket loads nothing. A range outside the bytes is a
    400 naming the tensor, and nothing changes. Controls: the bucket without its load_format is
    refused (a plain tensor list does not name SGLang's class); two same-sized tensors with their
    byte ranges swapped load each other's bits."""
    master = _trained(tiny)
    with torch.no_grad():
        for p in master.parameters():
            p.mul_(0.75)  # weights no other test pushes
    pairs = client.prepare(master.named_parameters())
    want = client.local_digests(pairs)
    assert client.weight_digests() != want

    def push(edit=None, subset=None, load_format="flattened_bucket") -> dict:
        payload, alive = _slime_bucket(pairs if subset is None else subset, monkeypatch, edit)
        body = {"serialized_named_tensors": [payload], "flush_cache": False, "weight_version": "bucket-1"}
        answer = client.post("/update_weights_from_tensor", body | {"load_format": load_format})
        del alive  # only now may the bytes go
        return answer

    with pytest.raises(WeightSyncError, match="400.*FlattenedTensorMetadata; only tensors may be sent"):
        push(load_format=None)
    before = client.weight_digests()

    def past_the_end(metadata):
        metadata[-1].end_idx += 2
        metadata[-1].numel += 2

    with pytest.raises(WeightSyncError, match=f"400.*{pairs[-1][0]}.*inside the bucket"):
        push(past_the_end)
    assert client.weight_digests() == before
    assert f"updated {len(pairs)} tensors" in push()["message"]
    assert client.weight_digests() == want and client.get_weight_version() == "bucket-1"
    assert "updated 0 tensors" in push(subset=[])["message"]  # slime's, for a rank with nothing to load
    a, b = next((i, j) for i, (_, t) in enumerate(pairs) for j, (_, u) in enumerate(pairs[i + 1 :], i + 1)
                if t.shape == u.shape and t.dtype == u.dtype)  # fmt: skip

    def swapped(metadata):
        for f in ("start_idx", "end_idx"):
            x, y = getattr(metadata[a], f), getattr(metadata[b], f)
            setattr(metadata[a], f, y)
            setattr(metadata[b], f, x)

    push(swapped)
    got = client.weight_digests()
    assert got[pairs[a][0]] == want[pairs[b][0]] != want[pairs[a][0]]


def test_a_cuda_device_is_an_index_or_a_visible_devices_uuid():
    """SGLang's patched reductions name a CUDA tensor's device by UUID; the receiver maps it to
    this process's index (on a GPU: tests/test_weight_sync_gpu.py's bucket arm). An index passes
    as is; a UUID no visible device has, or another type, is refused naming it."""
    from samebits.weights import ipc

    assert ipc.cuda_index(3) == 3
    with pytest.raises(ValueError, match="no visible CUDA device has the UUID 'GPU-0000'"):
        ipc.cuda_index("GPU-0000")
    with pytest.raises(ValueError, match="an index or a UUID, got float"):
        ipc.cuda_index(0.0)
