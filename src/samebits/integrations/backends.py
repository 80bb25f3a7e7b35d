"""Where a framework's rollout runs: a `samebits.LLM` in this process, or a `samebits serve`.

Both answer the same three calls: `generate(prompt_ids, params) -> [(token_ids, logprobs)]`,
`push(named_tensors)` (the trainer's weights, cast to the engine's dtype), and
`mismatched(named_tensors) -> names` (the tensors whose engine digest is not the trainer's).
The server is reached through samebits' own protocol only (`samebits.client`): concurrent SGLang
`/generate` calls, the weight-update group (gloo on CPU, NCCL on CUDA, the trainer rank 0) and
`/update_weights_from_distributed`, digests through `/weight_digests`.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import torch

from samebits.client import Client, WeightSyncError
from samebits.engine.digest import tensor_digest
from samebits.engine.llm import LLM
from samebits.requests import SamplingParams


class LocalEngine:
    """A `samebits.LLM` in this process; weights through `LLM.update_weights`, or, for an LLM
    built on the trainer's own tensors (`LLM(path, weights=model.named_parameters(...))`, one
    copy of the model on the device), no copy: a push checks that each tensor is still the
    engine's parameter and forgets the prefix cache (K/V of the old weights)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.shared = not llm.weight_store.owned

    def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[tuple[list, list]]:
        outs = self.llm.generate(prompt_ids, params, progress=False)
        return [(o.token_ids, o.logprobs.tolist()) for o in outs]  # float32 -> float -> the same float32

    def push(self, named_tensors) -> None:
        if not self.shared:
            self.llm.update_weights(self._cast(named_tensors))
            return
        params = self.llm.weight_store.params
        for name, tensor in named_tensors:
            mine = params.get(name)
            if mine is None or mine.data_ptr() != tensor.data_ptr() or mine.shape != tensor.shape:
                raise RuntimeError(
                    f"the engine runs on the trainer's shared tensors (LLM(weights=...)), but {name} is "
                    + ("not one of its parameters" if mine is None else "no longer the tensor it was built on")
                    + " (the trainer moved, cast or replaced it): build the LLM from the parameters the "
                    "trainer trains, after they are on their device and dtype, or give the rollout an LLM "
                    "that owns its weights"
                )
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("pushing weights: the engine has requests in flight")

    def mismatched(self, named_tensors) -> list[str]:
        mine = {n: tensor_digest(t) for n, t in self._cast(named_tensors)}
        return sorted(n for n, d in self.llm.weight_digests(list(mine)).items() if d != mine[n])

    def _cast(self, named_tensors) -> list[tuple[str, torch.Tensor]]:
        dtype = self.llm.engine.torch_dtype
        return [(n, t.detach().to(dtype)) for n, t in named_tensors]


class ServerEngine:
    """A `samebits serve` at `url`. The group is made on the first push, the trainer (this
    process) rank 0 listening on `group_address:group_port` (None: a free port), NCCL when the
    trainer's tensors are on CUDA, else gloo. `api_key`: the server's admin key, if it has one."""

    def __init__(self, url: str, api_key: str | None = None, group_address: str = "127.0.0.1", group_port=None):
        self.client = Client(url, api_key=api_key)
        self.group_address, self.group_port = group_address, group_port
        self.grouped = False
        try:
            self.client.weight_specs()  # reachable, and the key opens the weight endpoints
        except WeightSyncError as e:
            raise ValueError(f"cannot use the samebits server at {url}: {e}") from None
        self._check_formula_field()

    def _check_formula_field(self) -> None:
        """A server that ignored `logprob_formula` would report its default line silently: it
        must refuse an unknown name (before any work) to show that it reads the field."""
        body = {"max_new_tokens": 1, "logprob_formula": "no-such-formula"}
        try:
            self.client.generate([0], body)
        except WeightSyncError as e:
            if "logprob_formula" in str(e):
                return
            raise ValueError(f"the server refused a probe request unexpectedly: {e}") from None
        raise ValueError(
            f"the samebits server at {self.client.base_url} ignores sampling_params.logprob_formula, so "
            "it cannot report TRL's line: run a samebits version whose /generate takes it"
        )

    def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[tuple[list, list]]:
        with ThreadPoolExecutor(max_workers=min(64, len(prompt_ids))) as pool:
            return list(pool.map(self._one, prompt_ids, params))

    def _one(self, prompt: list[int], sp: SamplingParams) -> tuple[list, list]:
        body = {
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "max_new_tokens": sp.max_tokens,
            "ignore_eos": sp.ignore_eos,
            "stop_token_ids": list(sp.stop_token_ids) if sp.stop_token_ids else None,
            "sampling_seed": sp.seed,
            "logprob_formula": sp.logprob_formula,
        }
        answer = self.client.generate(list(prompt), body)
        return answer["output_ids"], [x[0] for x in answer["meta_info"]["output_token_logprobs"]]

    def push(self, named_tensors) -> None:
        pairs = list(named_tensors)
        if not self.grouped:
            backend = "nccl" if pairs and pairs[0][1].is_cuda else "gloo"
            port = self.group_port or _free_port()
            self.client.init_weights_update_group(self.group_address, port, backend=backend)
            self.grouped = True
        self.client.update_weights_from_distributed(pairs)

    def mismatched(self, named_tensors) -> list[str]:
        mine = self.client.local_digests(named_tensors)
        return sorted(n for n, d in self.client.weight_digests(list(mine)).items() if d != mine[n])

    def close(self) -> None:
        if self.grouped:
            self.client.destroy_weights_update_group()
            self.grouped = False


def engine_for(llm_or_url, **server_kwargs) -> LocalEngine | ServerEngine:
    """`samebits.LLM` -> LocalEngine; an http(s) URL -> ServerEngine(url, **server_kwargs)."""
    if isinstance(llm_or_url, LLM):
        if server_kwargs:
            raise ValueError(f"{sorted(server_kwargs)}: only for a server URL, not a samebits.LLM")
        return LocalEngine(llm_or_url)
    if isinstance(llm_or_url, str) and llm_or_url.startswith(("http://", "https://")):
        return ServerEngine(llm_or_url, **server_kwargs)
    raise TypeError(
        f"rollout_func takes a samebits.LLM or a samebits serve URL (http://...), got {llm_or_url!r}"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
