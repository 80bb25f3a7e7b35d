"""The engine's side of vLLM's NCCL weight transfer: what TRL's `VLLMClient.init_communicator`
and `update_named_params` drive through POST /init_weight_transfer_engine, /start_weight_update,
/update_weights and /finish_weight_update (`serve.vllm_api`). One `VllmReceiver` per engine, in
the engine's process; the calls are vLLM's `WeightTransferEngine` methods, by their names:

- `init_transfer_engine`: refused at once where the engine is not on CUDA. Else join rank 0's
  TCPStore as rank `rank_offset`, read the trainer's ncclUniqueId (`weights.vllm_transfer`),
  build the communicator (`weights.nccl`). Runs in a thread (the rendezvous waits on the
  trainer); a second init replaces the first communicator.
- `start_weight_update`: opens an update (staging is empty). Only checkpoint-format weights
  (transformers names) are taken.
- `receive_weights`: inside an open update only; the declared names, dtypes and shapes are
  checked against the model before a byte is received (a refusal answers at once); then the
  tensors are received (packed buckets or one by one, as the trainer sends them) into staging.
- `finish_weight_update`: closes the update and applies everything staged since the start at
  once through `LLM.update_weights` (finite values checked), or nothing. It runs once no
  request is in flight (`engine_child`): no request ever runs on half-updated weights.

A transport error halfway drops the update and the communicator (a failed collective leaves
it unusable): nothing is applied, the old weights keep serving. Staging holds what the open
update received, in the engine's device memory, until finish.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from samebits.weights import vllm_transfer as vt
from samebits.weights.receiver import parse_dtype

RECEIVE_TIMEOUT_S = 30 * 60.0  # torch's default process-group timeout
JOIN_TIMEOUT_S = 300.0


@dataclass
class Transfer:
    """A joined communicator and the wire settings the trainer gave at init (vLLM >= 0.28 puts
    `packed` there; older ones send it with each update, which then wins)."""

    comm: object  # weights.nccl.Communicator: broadcast(tensor, src), synchronize(timeout_s), abort()
    device: torch.device
    packed: bool = False
    buffer_bytes: int = vt.DEFAULT_BUFFER_BYTES
    store: object = None  # the TCPStore client, kept as long as the communicator


class VllmReceiver:
    def __init__(self, llm):
        self.llm = llm
        self.transfer: Transfer | None = None
        self.staged: dict[str, torch.Tensor] | None = None  # None: no update open
        self.lock = threading.Lock()  # a receive, against an init that replaces the communicator
        self.joining = False

    # -- the communicator ---------------------------------------------------------------

    def init_transfer_engine(self, init_info: dict) -> str:
        from samebits.weights import nccl

        device = self.llm.runner.device
        vt.require_cuda(device)
        info = init_info  # validated by serve.vllm_api.InitInfo
        with self.lock:  # waits for a receive in progress to end
            if self.joining:
                raise ValueError("init_info: a rendezvous is already under way; wait for its answer")
            old, self.transfer, self.joining = self.transfer, None, True
        t0 = time.perf_counter()
        try:
            if old is not None:
                old.comm.abort()
            rank, world_size = info["rank_offset"], info["world_size"]
            store = vt.join_store(info["master_address"], info["master_port"], rank, world_size, JOIN_TIMEOUT_S)
            comm = nccl.Communicator(vt.receive_unique_id(store), world_size, rank, device)
        finally:
            self.joining = False
        packed, size = info.get("packed", False), info.get("packed_buffer_size_bytes", vt.DEFAULT_BUFFER_BYTES)
        self.transfer = Transfer(comm, device, packed, size, store)
        return f"joined as rank {rank} of {world_size} in {time.perf_counter() - t0:.2f} s"

    def attach(self, transfer: Transfer) -> None:
        """Use `transfer` as the communicator (what `init_transfer_engine` builds)."""
        self.transfer = transfer

    # -- one update: start, receive (any number), finish --------------------------------

    def start_weight_update(self, is_checkpoint_format: bool = True) -> str:
        if not is_checkpoint_format:
            raise ValueError(
                "is_checkpoint_format: only checkpoint-format weights (transformers names) are taken; "
                "leave it out or send true"
            )
        if self.staged is not None:
            raise ValueError(
                f"start_weight_update: an update is already open ({len(self.staged)} tensors received); "
                "POST /finish_weight_update first"
            )
        self.staged = {}
        return "weight update started"

    def check_update(self, update_info: dict) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The declared tensors, checked against the model -> [(name, dtype, shape)]."""
        names, dtypes, shapes = update_info["names"], update_info["dtype_names"], update_info["shapes"]
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(
                "update_info: names, dtype_names and shapes must have one entry per tensor, "
                f"got {len(names)}, {len(dtypes)} and {len(shapes)}"
            )
        declared = [
            (n, parse_dtype(i, d, "dtype_names"), tuple(int(x) for x in s))
            for i, (n, d, s) in enumerate(zip(names, dtypes, shapes, strict=True))
        ]
        if declared:
            self.llm.weight_store.check_names(*zip(*declared, strict=True), where="update_weights")
        return declared

    def receive_weights(self, update_info: dict) -> str:
        if self.staged is None:
            raise ValueError(
                "update_weights: no update is open; POST /start_weight_update first "
                "(VLLMClient.update_named_params and weight_update() do)"
            )
        declared = self.check_update(update_info)
        t0 = time.perf_counter()
        with self.lock:
            transfer = self.transfer
            if transfer is None:
                raise ValueError(
                    "update_weights: no weight transfer engine; POST /init_weight_transfer_engine first"
                )
            packed = update_info.get("packed")
            packed = transfer.packed if packed is None else packed
            size = update_info.get("packed_buffer_size_bytes") or transfer.buffer_bytes
            received = self._receive(transfer, declared, packed, size)
        self.staged.update(received)
        nbytes = sum(t.numel() * t.element_size() for _, t in received)
        how, took = "packed" if packed else "one by one", time.perf_counter() - t0
        return f"received {len(received)} tensors ({nbytes / 2**20:.1f} MiB, {how}) in {took:.3f} s"

    def _receive(self, transfer: Transfer, declared: list, packed: bool, buffer_bytes: int) -> list:
        names, dtypes, shapes = ([d[k] for d in declared] for k in range(3))
        if packed:
            groups = vt.bucket_plan(shapes, dtypes, buffer_bytes)
        else:
            groups = [[i] for i in range(len(declared))]
        staged, step = [], ""
        try:
            for b, idx in enumerate(groups):
                step = f"bucket {b + 1} of {len(groups)} ({names[idx[0]]} ... {names[idx[-1]]})"
                if packed:
                    nbytes = sum(torch.Size(shapes[i]).numel() * dtypes[i].itemsize for i in idx)
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=transfer.device)
                    transfer.comm.broadcast(buf, src=0)
                    staged += vt.unpack(
                        buf, [names[i] for i in idx], [shapes[i] for i in idx], [dtypes[i] for i in idx]
                    )
                else:
                    buf = torch.empty(shapes[idx[0]], dtype=dtypes[idx[0]], device=transfer.device)
                    transfer.comm.broadcast(buf, src=0)
                    staged.append((names[idx[0]], buf))
            step = "the final synchronize"
            transfer.comm.synchronize(RECEIVE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any transport error: drop the update, keep the old weights
            self.transfer, self.staged = None, None
            transfer.comm.abort()
            raise ConnectionError(
                f"update_weights: receiving {step} failed: {e}; nothing was applied, the old weights keep "
                "serving; the update and the communicator were dropped: POST /init_weight_transfer_engine, "
                "then /start_weight_update again"
            ) from e
        return staged

    def close_weight_update(self, **_) -> dict:
        """Close the open update -> {"staged": what it received} (checked on arrival, so the
        update's finish, which waits for the engine to drain, applies exactly that)."""
        if self.staged is None:
            raise ValueError("finish_weight_update: no update is open; POST /start_weight_update first")
        staged, self.staged = self.staged, None
        return {"staged": staged}

    def finish_weight_update(self, staged: dict | None = None, **_) -> str:
        if staged is None:
            staged = self.close_weight_update()["staged"]
        t0 = time.perf_counter()
        if staged:
            self.llm.update_weights(list(staged.items()))
        nbytes = sum(t.numel() * t.element_size() for t in staged.values())
        return f"applied {len(staged)} tensors ({nbytes / 2**20:.1f} MiB) in {time.perf_counter() - t0:.3f} s"
