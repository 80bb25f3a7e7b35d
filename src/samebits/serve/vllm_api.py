"""vLLM's development endpoints that TRL's `VLLMClient` calls, in vLLM's JSON shapes.

- GET /get_world_size: `{"world_size": 1}`: one engine on one device (no tensor, pipeline or
  data parallelism), with or without `include_dp`;
- GET /server_info?config_format=json|text: `{"vllm_config": ...}`, the settings the server was
  started with under vLLM's config names. Only fields samebits has are written; each value is
  the server's own. `model_config.logprobs_mode` is the engine's (`samebits serve
  --logprobs-mode`, vLLM's flag and names; `trl vllm-serve` starts vLLM with processed_logprobs).
  `weight_transfer_config` names the protocol this server's weights are
  synced by (SGLang's endpoints, `weights_api.py`), or is null where it has none;
- POST /reset_prefix_cache: drops the prefix cache once nothing is in flight: `{"success"}`;
- POST /init_weight_transfer_engine, /start_weight_update, /update_weights,
  /finish_weight_update: 501 with an OpenAI error body. vLLM's NCCL weight-transfer backend
  (a StatelessProcessGroup rendezvous, PyNccl packed broadcasts) is not implemented; the
  message names the protocol that is.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import FastAPI, Query

from samebits.requests.sampling_params import MAX_LOGPROBS
from samebits.serve.errors import error_response
from samebits.serve.weights_api import _run

WEIGHT_ENDPOINTS = (
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/update_weights_from_disk",
)
VLLM_WEIGHT_TRANSFER = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)
NOT_IMPLEMENTED = (
    "{path}: vLLM's NCCL weight-transfer backend (a StatelessProcessGroup rendezvous and PyNccl packed "
    "broadcasts, what VLLMClient.init_communicator and update_named_params speak) is not implemented by "
    "samebits serve. Sync weights with SGLang's protocol, which this server speaks: POST "
    "/init_weights_update_group, then /update_weights_from_distributed (samebits.client.Client, "
    "docs/serve.md); for TRL's GRPOTrainer, the samebits.integrations.trl rollout_func does it for you"
)


def vllm_config(engine, model_name: str, settings: dict) -> dict:
    """The server's settings under vLLM's `VllmConfig` names (JSON form)."""
    path = str(getattr(engine, "path", settings.get("model", "")))
    weights = hasattr(engine, "call")  # the engine process: SGLang's weight endpoints are served
    transfer = {"backend": "sglang", "endpoints": list(WEIGHT_ENDPOINTS)} if weights else None
    return {
        "model_config": {
            "model": path,
            "tokenizer": path,
            "served_model_name": model_name,
            "dtype": settings.get("dtype"),
            "max_model_len": engine.max_model_len,
            "max_logprobs": MAX_LOGPROBS,
            "logprobs_mode": settings.get("logprobs_mode", "raw_logprobs"),
        },
        "cache_config": {
            "block_size": settings.get("block_size"),
            "num_gpu_blocks": settings.get("num_blocks"),
            "enable_prefix_caching": settings.get("enable_prefix_caching"),
        },
        "parallel_config": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "data_parallel_size": 1,
            "world_size": 1,
        },
        "scheduler_config": {
            "max_num_seqs": settings.get("max_num_seqs"),
            "max_num_batched_tokens": settings.get("max_num_batched_tokens"),
            "max_model_len": engine.max_model_len,
            "async_scheduling": settings.get("async_scheduling"),
        },
        "device_config": {"device": settings.get("device")},
        "lora_config": None,
        "weight_transfer_config": transfer,
    }


def register(app: FastAPI, engine, model_name: str, settings: dict | None = None) -> None:
    """Add the routes; `settings`: what the server was started with (`LLM`'s keyword arguments)."""
    settings = settings or {}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: Annotated[bool, Query()] = True):
        return {"world_size": 1}

    @app.get("/server_info")
    async def server_info(config_format: Annotated[Literal["text", "json"], Query()] = "text"):
        config = vllm_config(engine, model_name, settings)
        return {"vllm_config": config if config_format == "json" else str(config), "vllm_env": {}}

    if hasattr(engine, "call"):

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(
            reset_running_requests: Annotated[bool, Query()] = False,
            reset_external: Annotated[bool, Query()] = False,
        ):
            # waits for the requests in flight to finish (none is reset mid-way); no external cache
            return await _run(engine, "flush_cache")

    for path in VLLM_WEIGHT_TRANSFER:
        app.add_api_route(path, _not_implemented(path), methods=["POST"])


def _not_implemented(path: str):
    async def refuse():
        return error_response(501, NOT_IMPLEMENTED.format(path=path), None, "not_implemented_error")

    return refuse
