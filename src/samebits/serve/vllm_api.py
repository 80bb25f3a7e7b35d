"""vLLM's development endpoints that TRL's `VLLMClient` calls, in vLLM's JSON shapes.

- GET /get_world_size: `{"world_size": 1}`: one engine on one device (no tensor, pipeline or
  data parallelism), with or without `include_dp`;
- GET /server_info?config_format=json|text: `{"vllm_config": ...}`, the settings the server was
  started with under vLLM's config names. Only fields samebits has are written; each value is
  the server's own. `model_config.logprobs_mode` is the engine's (`samebits serve
  --logprobs-mode`, vLLM's flag and names; `trl vllm-serve` starts vLLM with processed_logprobs).
  `weight_transfer_config` is `{"backend": "nccl"}` where the engine is on CUDA (the four
  endpoints below), else SGLang's endpoints (`weights_api.py`), or null where it has none.
  Beside those two keys, SGLang's `ServerArgs` fields (`sglang_api.server_args`): SGLang 0.5
  serves them at this path, and slime reads it first;
- POST /reset_prefix_cache: drops the prefix cache once nothing is in flight: `{"success"}`;
- POST /init_weight_transfer_engine `{"init_info": {master_address, master_port, rank_offset,
  world_size, packed?, packed_buffer_size_bytes?, packed_num_buffers?}}`, /start_weight_update
  `{"is_checkpoint_format"?}`, /update_weights `{"update_info": {names, dtype_names, shapes,
  packed?, packed_buffer_size_bytes?, packed_num_buffers?}}`, /finish_weight_update
  `{"weight_version"?}`: vLLM's NCCL weight transfer, received by `weights.vllm_receiver`
  (its docstring has the semantics). 200: `{"message"}` with vLLM's text and `detail` with
  samebits'; 400 (an OpenAI error body) for a refusal: a CPU engine (naming CUDA), a tensor
  the model does not have or with another shape or dtype, an update outside start/finish;
  500 for a transport that failed halfway. Nothing is applied unless finish succeeds.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse
from pydantic import Field

from samebits.requests.sampling_params import MAX_LOGPROBS
from samebits.serve.errors import error_response
from samebits.serve.sglang_api import _weight_version, server_args
from samebits.serve.weights_api import _Body, _run, call
from samebits.weights.vllm_transfer import DEFAULT_BUFFER_BYTES

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


class InitInfo(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False  # vLLM >= 0.28 sends it here; older ones with each update
    packed_buffer_size_bytes: int = Field(DEFAULT_BUFFER_BYTES, gt=0)
    packed_num_buffers: int = Field(2, gt=0)  # the trainer's streams; the bytes do not depend on it


class InitTransfer(_Body):
    init_info: InitInfo


class StartUpdate(_Body):
    is_checkpoint_format: bool = True


class UpdateInfo(_Body):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool | None = None  # None: as the init said
    packed_buffer_size_bytes: int | None = Field(None, gt=0)
    packed_num_buffers: int | None = Field(None, gt=0)


class UpdateWeights(_Body):
    update_info: UpdateInfo


class FinishUpdate(_Body):
    weight_version: str | None = None
    abort_all_requests: bool = False  # samebits' (SGLang's): abort the requests in flight instead


def vllm_config(engine, model_name: str, settings: dict) -> dict:
    """The server's settings under vLLM's `VllmConfig` names (JSON form)."""
    path = str(getattr(engine, "path", settings.get("model", "")))
    weights = hasattr(engine, "call")  # the engine process: the weight endpoints are served
    transfer = {"backend": "sglang", "endpoints": list(WEIGHT_ENDPOINTS)} if weights else None
    if weights and str(getattr(engine, "device", "cpu")).startswith("cuda"):
        transfer = {"backend": "nccl"}  # vLLM's, as `--weight-transfer-config` sets it
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
        # SGLang 0.5's /server_info is its ServerArgs (slime reads it before /get_server_info):
        # those fields beside vLLM's two keys, each client reading its own
        sglang = server_args(engine, model_name, settings) | await _weight_version(engine)
        return sglang | {"vllm_config": config if config_format == "json" else str(config), "vllm_env": {}}

    if hasattr(engine, "call"):

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(
            reset_running_requests: Annotated[bool, Query()] = False,
            reset_external: Annotated[bool, Query()] = False,
        ):
            # waits for the requests in flight to finish (none is reset mid-way); no external cache
            return await _run(engine, "flush_cache")

        register_transfer(app, engine)
    else:
        for path in VLLM_WEIGHT_TRANSFER:
            app.add_api_route(path, _not_served(path), methods=["POST"])


def register_transfer(app: FastAPI, engine) -> None:
    """The four weight-transfer routes, over the engine process (`EngineProcess.call`)."""

    # each body's fields are the engine call's arguments
    @app.post("/init_weight_transfer_engine")
    async def init_transfer(body: InitTransfer):
        return await _answer(engine, "Weight transfer initialized", "init_transfer_engine", body)

    @app.post("/start_weight_update")
    async def start_update(body: StartUpdate | None = None):
        return await _answer(engine, "Weight update started", "start_weight_update", body or StartUpdate())

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeights):
        return await _answer(engine, "Weights updated", "receive_weights", body)

    @app.post("/finish_weight_update")
    async def finish_update(body: FinishUpdate | None = None):
        return await _answer(engine, "Weight update finished", "finish_weight_update", body or FinishUpdate())


async def _answer(engine, done: str, method: str, body: _Body) -> JSONResponse:
    """vLLM's `{"message": done}` on success (`detail`: what the engine did), else an OpenAI
    error body with `weights_api.call`'s status."""
    status, value = await call(engine, method, **body.model_dump())
    if status != 200:
        return error_response(
            status, str(value), None, "invalid_request_error" if status == 400 else "server_error"
        )
    return JSONResponse({"message": done, "detail": "" if value is None else str(value)})


def _not_served(path: str):
    async def refuse():
        message = f"{path}: vLLM's weight transfer needs the engine in its own process (samebits serve)"
        return error_response(501, message, None, "not_implemented_error")

    return refuse
