"""The trainer's side of weight sync with a `samebits serve` (or SGLang) server.

    from samebits.client import Client
    client = Client("http://127.0.0.1:30000", api_key=KEY)                 # None: no key sent
    client.init_weights_update_group("127.0.0.1", 29600, backend="gloo")   # the trainer is rank 0
    client.update_weights_from_distributed(model.named_parameters())      # fp32 -> engine dtype
    assert client.weight_digests() == client.local_digests(model.named_parameters())

`update_weights_from_distributed` checks every name, shape and dtype against the server's
(`/weight_specs`) before anything is sent, then posts the declaration and broadcasts each
tensor from rank 0 in the same order, as SGLang's protocol has it. `update_weights_from_tensor`
hands a colocated engine (same GPU, another process) CUDA IPC handles instead. Every method
raises `WeightSyncError` with the server's message when the server refuses. `api_key` is sent
as `Authorization: Bearer <key>` on every call: give the admin key (`--admin-api-key`) of a
server that has one, since weight updates, digests and specs need it.

Only the standard library talks HTTP here; the group is `samebits.weights.group`'s, made as
SGLang's `init_custom_process_group` makes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from samebits.engine.digest import tensor_digest
from samebits.engine.weight_store import per_expert_target
from samebits.weights import group as groups
from samebits.weights import ipc

DEFAULT_GROUP = "weight_update_group"


def spawn_server(
    model, *args: str, ready_timeout: float = 1800.0, api_key: str | None = None
) -> tuple[subprocess.Popen, str]:
    """Start `samebits serve --model model --port 0 *args` on 127.0.0.1 and wait for its ready
    line -> (the process, its URL). RuntimeError with the server's stderr if it exits first;
    killed after `ready_timeout` seconds (a 60 GB checkpoint and its CUDA graphs take minutes).
    `api_key`: the server's key, handed over in its environment ($VLLM_API_KEY), not on its
    command line. Stop it with `stop_server`."""
    cmd = [sys.executable, "-m", "samebits.cli", "serve", "--model", str(model), "--port", "0", *args]
    env = dict(os.environ, VLLM_API_KEY=api_key) if api_key else None
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    timer = threading.Timer(ready_timeout, proc.kill)
    timer.start()
    seen: list[str] = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "ready on http://" in line:
                threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
                return proc, line.split("ready on ")[1].split()[0]
    finally:
        timer.cancel()
    raise RuntimeError(f"samebits serve exited ({proc.wait()}) before it was ready:\n{''.join(seen)}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server started by `spawn_server`, by its PID; SIGKILL if it lingers."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


class WeightSyncError(RuntimeError):
    """The server refused a call (its message says why), or could not be reached."""


class Client:
    """HTTP calls to one server, plus the rank-0 end of its weight-update group."""

    def __init__(
        self, base_url: str = "http://127.0.0.1:30000", timeout: float = 3600.0, api_key: str | None = None
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.groups: dict[str, tuple[object, str]] = {}  # name -> (process group, backend)
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None

    # -- HTTP ---------------------------------------------------------------------------

    def post(self, path: str, body: dict | None = None) -> dict:
        """POST a JSON body -> the JSON answer; WeightSyncError on a non-2xx answer."""
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            headers={"Content-Type": "application/json"} | self._headers,
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                doc = json.loads(text)
                text = doc.get("message") or doc.get("error", {}).get("message") or text
            except (json.JSONDecodeError, AttributeError):
                pass
            raise WeightSyncError(f"POST {path}: {e.code}: {text}") from None
        except urllib.error.URLError as e:
            raise WeightSyncError(f"POST {path}: cannot reach {self.base_url}: {e.reason}") from None

    def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True) -> dict:
        """SGLang's /generate for one prompt of token ids -> its answer (`output_ids`, and
        `meta_info.output_token_logprobs` as [log-prob, token id, None] triples)."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        return self.post("/generate", body)

    # -- the group ----------------------------------------------------------------------

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int = 2,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
    ):
        """Make the group with the server (ranks 1..world_size-1), this process rank 0 -> it."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": 1,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        answer = _Background(self.post, "/init_weights_update_group", body)
        joined = _Background(
            groups.init_custom_process_group, backend, master_address, master_port, world_size, 0, group_name
        )
        while not joined.done():  # a server that refuses answers at once: do not wait out the rendezvous
            if answer.done() and answer.failed():
                answer.result()  # raises the server's message (the rendezvous thread is left to time out)
            joined.wait(0.05)
        pg = joined.result()
        answer.result()
        self.groups[group_name] = (pg, backend)
        return pg

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        pg, _ = self.groups.pop(group_name, (None, None))
        try:
            self.post("/destroy_weights_update_group", {"group_name": group_name})
        finally:
            if pg is not None:
                groups.destroy(pg)

    # -- updates ------------------------------------------------------------------------

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The server's tensors: name -> (shape, dtype). Cached; `refresh_specs()` re-reads."""
        if self._specs is None:
            specs = self.post("/weight_specs", {})["specs"]
            self._specs = {n: (tuple(s["shape"]), getattr(torch, s["dtype"])) for n, s in specs.items()}
        return self._specs

    def refresh_specs(self) -> None:
        self._specs = None

    def prepare(self, named_tensors) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs cast to the server's dtype, contiguous, checked against its
        specs (ValueError naming the tensor), detached. fp32 master weights become bf16 here."""
        specs, out, seen = self.weight_specs(), [], set()
        for name, tensor in _pairs(named_tensors):
            shape, dtype = _spec(specs, name)
            if name in seen:
                raise ValueError(f"{name}: given twice")
            seen.add(name)
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the server's is {shape}")
            out.append((name, tensor.detach().to(dtype).contiguous()))
        return out

    def update_weights_from_distributed(
        self,
        named_tensors,
        group_name: str = DEFAULT_GROUP,
        bucket_bytes: int | None = None,
        abort_all_requests: bool = False,
        checked: bool = True,
        weight_version: str | None = None,
    ) -> list[str]:
        """Broadcast the tensors to the server through the group -> the server's messages.

        One request per bucket of at most `bucket_bytes` (None: one request, so the update is
        all or nothing; each bucket is all or nothing on its own). `checked=False` skips the
        local check against /weight_specs (the server still checks before receiving).
        `weight_version`: what /get_weight_version reports once the last bucket landed."""
        pg, backend = self._group(group_name)
        pairs = self.prepare(named_tensors) if checked else [(n, t.detach()) for n, t in _pairs(named_tensors)]
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        messages, buckets = [], _buckets(pairs, bucket_bytes)
        for i, bucket in enumerate(buckets):
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": group_name,
                "abort_all_requests": abort_all_requests,
                "weight_version": weight_version if i == len(buckets) - 1 else None,
            }
            answer = _Background(self.post, "/update_weights_from_distributed", body)
            for _, tensor in bucket:
                dist.broadcast(tensor.to(device), src=0, group=pg)
            messages.append(answer.result()["message"])
        return messages

    def update_weights_from_tensor(
        self, named_tensors, abort_all_requests: bool = False, weight_version: str | None = None
    ) -> str:
        """Hand a colocated server the tensors by reference (CUDA IPC; shared files on the
        CPU) -> its message. The tensors are kept alive until the server has copied them."""
        pairs = self.prepare(named_tensors)
        body = {
            "serialized_named_tensors": [ipc.serialize(pairs)],
            "abort_all_requests": abort_all_requests,
            "weight_version": weight_version,
        }
        answer = self.post("/update_weights_from_tensor", body)
        del pairs  # only now may the memory go
        return answer["message"]

    def update_weights_from_disk(
        self, model_path: str, abort_all_requests: bool = False, weight_version: str | None = None
    ) -> str:
        body = {"model_path": str(model_path), "abort_all_requests": abort_all_requests}
        body["weight_version"] = weight_version
        return self.post("/update_weights_from_disk", body)["message"]

    def weight_digests(self, names: Iterable[str] | None = None, kind: str = "sha256") -> dict[str, str]:
        """The server's digest of each named tensor (all when None)."""
        body = {"names": None if names is None else list(names), "kind": kind}
        return self.post("/weight_digests", body)["digests"]

    def local_digests(self, named_tensors, kind: str = "sha256") -> dict[str, str]:
        """The same digests of what `prepare` would send (cast to the server's dtypes)."""
        return {name: tensor_digest(t, kind) for name, t in self.prepare(named_tensors)}

    def get_weight_version(self) -> str:
        """The `weight_version` of the last update that carried one ("default" before)."""
        req = urllib.request.Request(self.base_url + "/get_weight_version", headers=self._headers, method="GET")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())["weight_version"]
        except urllib.error.URLError as e:
            raise WeightSyncError(f"GET /get_weight_version: {e}") from None

    def flush_cache(self) -> None:
        self.post("/flush_cache")

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.post("/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.post("/resume_memory_occupation", {"tags": tags})

    def _group(self, group_name: str):
        if group_name not in self.groups:
            raise WeightSyncError(f"no group {group_name!r}: call init_weights_update_group first")
        return self.groups[group_name]


class _Background:
    """One HTTP call in a thread (the server answers only after the collective it waits on)."""

    def __init__(self, fn, *args):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn, *args) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in result()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def failed(self) -> bool:
        return self._error is not None

    def wait(self, timeout: float) -> None:
        self._thread.join(timeout)

    def result(self, timeout: float | None = None):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise WeightSyncError("the server has not answered yet")
        if self._error is not None:
            raise self._error
        return self._value


def _spec(specs: dict, name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) the server expects for `name`: one of its tensors, or a hub per-expert
    name (its expert's slice of a fused tensor: `weight_store.per_expert_target`)."""
    if name in specs:
        return specs[name]
    target = per_expert_target(name, {n: shape for n, (shape, _) in specs.items()})
    if target is None:
        raise ValueError(f"{name}: the server has no such tensor (see Client.weight_specs())")
    fused, expert, _, shape = target
    if expert >= specs[fused][0][0]:
        raise ValueError(f"{name}: expert {expert} of {specs[fused][0][0]}")
    return shape, specs[fused][1]


def _pairs(named_tensors) -> list[tuple[str, torch.Tensor]]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return [(str(n), t) for n, t in items]


def _buckets(pairs: list, bucket_bytes: int | None) -> list[list]:
    if bucket_bytes is None:
        return [pairs]
    out, size = [[]], 0
    for name, t in pairs:
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nbytes
    return out
