"""verl's rollout driving samebits: a `RolloutReplica` named "samebits" (docs/integrations.md).

    import samebits.integrations.verl        # registers "samebits" with verl (import-time)

    actor_rollout_ref.rollout.name=samebits
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.model.external_lib=samebits.integrations.verl   # every verl process registers it

Three pieces, shaped as verl 0.9.1's vLLM backend is (`workers/rollout/vllm_rollout/`):

- `SamebitsServer`, the Ray actor of a replica (verl's `vLLMHttpServer`): a `samebits.LLM` under
  an `AsyncEngine`; `generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput`
  takes verl's sampling dict as the vLLM server maps it, each sampled token's log-prob by verl's
  own line (`logprob_formula="verl"`: its FSDP engine's temperature division, then
  `logprobs_from_logits`; docs/logprobs.md), and the control methods verl calls (sleep,
  wake_up, clear_kv_cache, abort/resume, set_global_steps).
- `SamebitsReplica`, registered in `RolloutReplicaRegistry`: launches that actor, named as
  verl names its servers (`samebits_server_{replica}_{node}`).
- `ServerAdapter`, the trainer side (`BaseRollout`, in verl's `get_rollout_class` table): verl's
  worker calls `update_weights(per_tensor_param, global_steps=...)` on it (the "naive"
  checkpoint engine, trainer and rollout colocated); it ships the tensors in buckets of
  `checkpoint_engine.update_weights_bucket_megabytes` to the server through Ray, which casts
  them to the engine's dtype and loads them with `LLM.update_weights`.

Refused at construction, naming what to change: tensor/data/pipeline/expert parallel > 1,
PD disaggregation, LoRA, quantization, MTP, routing replay, repetition_penalty != 1; images,
video and audio at the first request that carries them. Tested with verl 0.9.1 on the CPU.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.plugin.platform import get_platform
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import get_resource_name
from verl.workers.rollout import base as verl_rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

from samebits.engine.async_engine import AsyncEngine
from samebits.engine.llm import LLM
from samebits.integrations.backends import LocalEngine
from samebits.requests import SamplingParams

NAME = "samebits"
FORMULA = "verl"  # verl 0.9.1's FSDP line (numerics/logprob_formulas.py)
_FINISHED = {"stop": "completed", "length": "completed", "abort": "aborted"}  # vLLM server's map


def register() -> None:
    """Make `rollout.name=samebits` resolve in this process: the replica class in
    `RolloutReplicaRegistry`, the trainer-side `ServerAdapter` in `get_rollout_class`'s table.
    Importing this module does it; verl imports `model.external_lib` in each of its processes."""
    RolloutReplicaRegistry.register(NAME, lambda: SamebitsReplica)
    verl_rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.ServerAdapter"


def check_config(config) -> None:
    """ValueError naming the field to change where `config` (verl's RolloutConfig) asks for
    something this backend does not do."""
    for field in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        if getattr(config, field) != 1:
            raise ValueError(
                f"actor_rollout_ref.rollout.{field}={getattr(config, field)}: samebits runs one process per "
                f"replica; set {field}=1 (more replicas come from more GPUs: n_gpus_per_node, nnodes)"
            )
    refused = {
        "expert_parallel_size": (config.expert_parallel_size, 1),
        "disaggregation.enabled": (config.disaggregation.enabled, False),
        "quantization": (config.quantization, None),
        "enable_rollout_routing_replay": (config.enable_rollout_routing_replay, False),
        "repetition_penalty": (config.repetition_penalty, 1.0),
        "mtp.enable": (bool(config.mtp and config.mtp.enable), False),
    }
    for field, (value, off) in refused.items():
        if value != off:
            raise ValueError(
                f"actor_rollout_ref.rollout.{field}={value!r}: not supported by samebits; set {off}"
            )
    if config.mode != "async":
        raise ValueError(f"actor_rollout_ref.rollout.mode={config.mode!r}: samebits is a server; set async")


def _check_model(model_config) -> None:
    """LoRA only merged into the weights verl sends (verl's worker then sends no adapter)."""
    lora = getattr(model_config, "lora", None) or {}
    if (getattr(model_config, "lora_rank", 0) or lora.get("rank", 0)) and not lora.get("merge", False):
        raise ValueError(
            "LoRA as an adapter: samebits takes full weights; set actor_rollout_ref.model.lora.merge=True "
            "(verl merges the adapter before each push) or lora_rank=0"
        )


def engine_options(config, model_config) -> dict:
    """`samebits.LLM` keywords from verl's rollout and model configs; `engine_kwargs.samebits`
    (any LLM keyword: num_blocks, numerics, device, logprob_formula for controls) overrides them.
    max_model_len None: prompt_length + response_length, capped by the model's positions."""
    positions = model_config.hf_config.get_text_config().max_position_embeddings
    options = dict(
        dtype=config.dtype,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len or min(config.prompt_length + config.response_length, positions),
        enable_prefix_caching=config.enable_prefix_caching,
        logprob_formula=FORMULA,
        logprobs_mode=config.logprobs_mode or "raw_logprobs",
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    return options | dict((config.engine_kwargs or {}).get(NAME) or {})


class SamebitsServer:
    """A replica's server (Ray actor): verl calls `generate` and the control methods on it.
    `config`, `model_config`: verl's RolloutConfig and HFModelConfig (or their DictConfigs)."""

    def __init__(self, config, model_config, rollout_mode: RolloutMode, replica_rank: int, node_rank: int = 0):
        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config)
        check_config(self.config)
        self.rollout_mode, self.replica_rank, self.node_rank = rollout_mode, replica_rank, node_rank
        self.llm = LLM(self.model_config.local_path, **engine_options(self.config, self.model_config))
        self.max_model_len = self.llm.engine.max_model_len
        self.engine = AsyncEngine(self.llm)
        self.weights = LocalEngine(self.llm)  # push/mismatched: cast to the engine's dtype, load, digest
        self.global_steps = None
        self._gate = asyncio.Event()
        self._gate.set()

    def get_server_address(self) -> tuple[str, None]:
        """No HTTP server: token-in-token-out through the actor handle only."""
        return f"{NAME}-replica-{self.replica_rank}", None

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data=None,
        video_data=None,
        audio_data=None,
        mm_processor_kwargs=None,
        priority: int = 0,
        **kwargs,
    ) -> TokenOutput:
        """verl's token-in-token-out call, as `vLLMHttpServer.generate` answers it."""
        if any(x is not None for x in (image_data, video_data, audio_data)):
            raise NotImplementedError("samebits' verl backend takes text prompts only, got image/video/audio")
        await self._gate.wait()
        prompt_ids = [int(t) for t in prompt_ids]
        params = self.sampling_params(len(prompt_ids), dict(sampling_params))
        want_logprobs = bool(sampling_params.get("logprobs", False))  # the sampled token's: always computed
        final = None
        async for out in self.engine.generate(prompt_ids, params, request_id):
            final = out
        extra = {"global_steps": self.global_steps, "num_cached_tokens": None}
        return TokenOutput(
            token_ids=list(final.token_ids),
            log_probs=final.logprobs.tolist()
            if want_logprobs
            else None,  # float32 -> float -> the same float32
            stop_reason=_FINISHED.get(final.finish_reason, final.finish_reason),
            num_preempted=final.num_preemptions,
            extra_fields=extra,
        )

    def sampling_params(self, prompt_len: int, sp: dict) -> SamplingParams:
        """verl's sampling dict -> SamplingParams, by the vLLM server's rules: max_tokens (or
        max_new_tokens) else the configured response budget, clamped to [1, max_model_len -
        prompt]; temperature 0 is greedy. `logprobs` (True: the sampled token's, which samebits
        always reports) asks for no top-k list."""
        c = self.config
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(
                f"a prompt of {prompt_len} tokens leaves no room in max_model_len {self.max_model_len}"
            )
        default = min(c.response_length, c.prompt_length + c.response_length - prompt_len)
        max_tokens = sp.pop("max_tokens", sp.pop("max_new_tokens", default))
        if sp.pop("repetition_penalty", 1.0) != 1.0:
            raise ValueError("sampling_params.repetition_penalty != 1 is not supported by samebits")
        seed = sp.pop("seed", self.replica_rank + c.seed if c.full_determinism else None)
        known = {"temperature", "top_p", "top_k", "logprobs", "ignore_eos", "min_tokens", "stop_token_ids"}
        if unknown := set(sp) - known:
            raise ValueError(f"sampling_params {sorted(unknown)} are not supported by samebits' verl backend")
        stops = sp.get("stop_token_ids")
        return SamplingParams(
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            top_k=int(sp.get("top_k", -1)),
            max_tokens=max(1, min(int(max_tokens), room)),
            min_tokens=int(sp.get("min_tokens", 0)),
            ignore_eos=bool(sp.get("ignore_eos", c.ignore_eos)),
            stop_token_ids=tuple(stops) if stops else None,
            seed=seed,
            detokenize=False,
        )

    # -- weights: ServerAdapter.update_weights sends the buckets --------------------------------

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket of the trainer's (name, tensor) pairs, cast to the engine's dtype."""
        await asyncio.to_thread(self.weights.push, named_tensors)

    def weight_digests(self, names: list[str] | None = None) -> dict[str, str]:
        """sha256 of each engine tensor (all when names is None): `samebits.engine.digest`."""
        return self.llm.weight_digests(names)

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # -- memory and requests: what verl's trainer calls around a step ---------------------------

    async def sleep(self) -> None:
        """Release the KV cache (hybrid mode with free_cache_engine); weights stay."""
        if self.config.free_cache_engine and self.rollout_mode == RolloutMode.HYBRID and not self.llm.asleep:
            await asyncio.to_thread(self.llm.release_memory_occupation, ["kv_cache"])

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.llm.asleep and (tags is None or "kv_cache" in tags):
            await asyncio.to_thread(self.llm.resume_memory_occupation, ["kv_cache"])

    async def release_kv_cache(self) -> None:
        await self.sleep()

    async def resume_kv_cache(self) -> None:
        await self.wake_up(["kv_cache"])

    async def clear_kv_cache(self) -> None:
        self.llm.reset_prefix_cache()

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Hold new requests until `resume_generation`, abort the ones in flight."""
        self._gate.clear()
        n = self.engine.num_in_flight()
        self.engine.abort_all()
        return {"aborted_count": n, "request_ids": []}

    async def resume_generation(self) -> None:
        self._gate.set()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        self.engine.abort(request_id)
        return {"aborted": True, "request_id": request_id}

    async def start_profile(self, **kwargs) -> None:
        pass

    async def stop_profile(self) -> None:
        pass


class SamebitsReplica(RolloutReplica):
    """verl's `RolloutReplica` for samebits: one `SamebitsServer` actor per replica."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_config(self.config)
        _check_model(self.model_config)
        self.server_class = ray.remote(SamebitsServer)

    async def init_standalone(self):
        """Standalone: the server actor alone (verl's base class also starts a GPU worker group
        for its CUDA/RDMA checkpoint engines, which samebits does not receive from); weights
        reach it through `ServerAdapter.update_weights`."""
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def launch_servers(self):
        name = f"{NAME}_server_{self.replica_rank}_0{self.name_suffix}"
        options = dict(name=name, max_concurrency=self.max_concurrency) | await self._placement()
        server = self.server_class.options(**options).remote(
            config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
            replica_rank=self.replica_rank,
        )  # fmt: skip
        self.servers = [server]
        self._server_handle = server
        self._server_address, _ = await server.get_server_address.remote()

    async def _placement(self) -> dict:
        """Ray options that put the server on its device. Hybrid: the node and accelerator of the
        trainer rank it shares them with, as `vLLMReplica.launch_servers` does (Ray told not to
        reset the visible devices); standalone: one GPU where the cluster has any, else the CPU."""
        if not self.workers:
            return {"num_gpus": 1} if ray.cluster_resources().get("GPU", 0) > 0 else {}

        def where(worker):
            ids = ray.get_runtime_context().get_accelerator_ids().get(get_resource_name()) or []
            return ray.get_runtime_context().get_node_id(), ids

        node, ids = await self.workers[0].__ray_call__.remote(where)
        env = {var: "1" for var in get_platform().ray_noset_envvars()} | get_platform().rollout_env_vars()
        if ids:
            env["CUDA_VISIBLE_DEVICES"] = str(ids[0])
        return {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False),
            "runtime_env": {"env_vars": env},
        }


class ServerAdapter(BaseRollout):
    """The trainer side (verl's worker builds it through `get_rollout_class("samebits")`):
    `update_weights` ships the trainer's tensors to its replica's server; resume/release wake
    and sleep it. A replica is one process, so trainer rank r feeds replica r (vLLM's map,
    `rank // rollout_world_size`), each rank consuming its own weight generator."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        check_config(self.config)
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank if replica_rank == -1 else replica_rank
        self.is_leader_rank = True  # every rank is its replica's only one
        self.server_handle = None

    def _server(self):
        if self.server_handle is None:
            self.server_handle = ray.get_actor(f"{NAME}_server_{self.replica_rank}_0")
        return self.server_handle

    async def resume(self, tags: list[str]):
        if self.config.free_cache_engine:
            await self._server().wake_up.remote(tags=tags)

    async def release(self):
        if self.config.free_cache_engine:
            await self._server().sleep.remote()

    @torch.no_grad()
    async def update_weights(
        self, weights, global_steps: int | None = None, wire_format: str = "named_tensors", **kwargs
    ):
        """Send (name, tensor) pairs in buckets of update_weights_bucket_megabytes, then clear the
        prefix cache and tag the weights with `global_steps`, as verl's vLLM adapter does."""
        if wire_format != "named_tensors":
            raise NotImplementedError(
                f"wire_format={wire_format!r}: samebits takes full tensors (named_tensors)"
            )
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("LoRA adapters: samebits takes merged weights; set model.lora.merge=True")
        server = self._server()
        limit = self.config.checkpoint_engine.update_weights_bucket_megabytes << 20
        bucket, size = [], 0
        async for name, tensor in ensure_async_iterator(weights):
            tensor = tensor.detach().to("cpu")
            if bucket and size + tensor.nbytes > limit:
                await server.update_weights.remote(bucket)
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += tensor.nbytes
        if bucket:
            await server.update_weights.remote(bucket)
        await server.clear_kv_cache.remote()
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)


register()
