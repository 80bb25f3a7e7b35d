"""`samebits rl --server`: the loop's trainer in its own process, the engine a `samebits serve`.

`RemoteEngine` answers the calls `RLLoop` makes of its engine (`generate`, `update_weights`,
`weight_digests`, `sleep`, `wake_up`, `config`) through HTTP and the weight-update group only,
as an external framework (verl, slime, OpenRLHF) drives SGLang: rollouts are concurrent
`/generate` calls (so the server batches them as it likes), weights go through
`/update_weights_from_distributed` + the group's broadcasts (`weight_sync="distributed"`) or
CUDA IPC handles (`"tensor"`, a server on the same GPU), digests through `/weight_digests`.

`server="spawn"` starts `samebits serve` on 127.0.0.1 for the run (stopped by its PID at the
end); any other value is the URL of a running server. The key sent to it, if any, is
$VLLM_API_KEY (`samebits rl --api-key` sets it): kept out of the config, so out of the run's
files.
"""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from samebits.client import Client, spawn_server, stop_server
from samebits.model.qwen3_moe.config import ModelConfig


@dataclass
class RemoteOutput:
    """What the loop reads of a rollout (`RequestOutput`'s fields of the same names)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor  # float32: the JSON numbers read back to the server's bits


class RemoteEngine:
    """The engine of `RLLoop`, reached over HTTP (see the module docstring)."""

    def __init__(self, server: str, path: Path, config):
        self.proc = None
        key = os.environ.get("VLLM_API_KEY") or None
        url = self._spawn(path, config, key) if server == "spawn" else server
        self.config = ModelConfig.from_pretrained(path)  # vocab_size for the prompts
        self.client = Client(url, timeout=3600, api_key=key)
        self.sync = config.weight_sync
        if self.sync == "distributed":
            backend = "nccl" if torch.device(config.device).type == "cuda" else "gloo"
            self.client.init_weights_update_group("127.0.0.1", _free_port(), backend=backend)

    def _spawn(self, path: Path, config, key: str | None) -> str:
        args = ["--device", config.device, "--dtype", config.dtype, "--numerics", config.engine_numerics]
        args += ["--logprob-formula", config.logprob_formula]
        args += ["--max-num-seqs", str(config.num_sequences), "--max-model-len", str(config.max_model_len)]
        self.proc, url = spawn_server(path, *args, api_key=key)
        return url

    # -- what RLLoop calls --------------------------------------------------------------

    def generate(self, prompts, params, progress: bool = False) -> list[RemoteOutput]:
        """All requests at once (the server batches them), outputs in order."""
        with ThreadPoolExecutor(max_workers=min(64, len(prompts))) as pool:
            return list(pool.map(self._one, prompts, params))

    def _one(self, prompt: list[int], sp) -> RemoteOutput:
        body = {
            "temperature": sp.temperature,
            "max_new_tokens": sp.max_tokens,
            "min_new_tokens": sp.min_tokens,
            "ignore_eos": sp.ignore_eos,
            "sampling_seed": sp.seed,
        }
        answer = self.client.generate(list(prompt), body)
        lps = [x[0] for x in answer["meta_info"]["output_token_logprobs"]]
        return RemoteOutput(list(prompt), answer["output_ids"], torch.tensor(lps, dtype=torch.float32))

    def update_weights(self, named_tensors) -> None:
        pairs = list(named_tensors)
        if self.sync == "distributed":
            self.client.update_weights_from_distributed(pairs)
        else:
            self.client.update_weights_from_tensor(pairs)

    def weight_digests(self, names, kind: str = "sha256") -> dict[str, str]:
        return self.client.weight_digests(names, kind)

    def sleep(self) -> None:
        """The server keeps its KV cache (another process, maybe another GPU)."""

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        for name in list(self.client.groups):
            try:
                self.client.destroy_weights_update_group(name)
            except Exception:  # noqa: BLE001 - the server may be gone already
                pass
        if self.proc is not None:
            stop_server(self.proc)
            self.proc = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
