"""SGLang's info endpoints, which slime, AReaL and OpenRLHF's SGLang path read, in SGLang's shapes.

- GET /model_info and /get_model_info: `model_path`, `tokenizer_path`, `is_generation`,
  `preferred_sampling_params` (null: none) and, with the engine process, `weight_version`;
- GET /get_server_info: the server's settings under SGLang's `ServerArgs` names, each the
  server's own value (one engine on one device: every parallel size 1); fields samebits has no
  counterpart for are left out, not invented. SGLang 0.5 names it /server_info, the route vLLM's
  clients read too: there (vllm_api.py) the same fields sit beside `vllm_config`;
- GET /health_generate: 200 `{}` once the engine has sampled one token of a one-token prompt
  (SGLang's check that generation works, not only the process); 503 with an error body if not.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI

from samebits.engine.async_engine import EngineDeadError
from samebits.requests.sampling_params import SamplingParams
from samebits.serve.errors import error_response


async def _weight_version(engine) -> dict:
    if not hasattr(engine, "call"):
        return {}
    try:
        return {"weight_version": (await engine.call("get_weight_version"))["weight_version"]}
    except EngineDeadError:
        return {}


def server_args(engine, model_name: str, settings: dict) -> dict:
    """The settings under SGLang's `ServerArgs` names."""
    path = str(getattr(engine, "path", settings.get("model", "")))
    return {
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": model_name,
        "dtype": settings.get("dtype"),
        "device": settings.get("device"),
        "context_length": engine.max_model_len,
        "max_running_requests": settings.get("max_num_seqs"),
        "chunked_prefill_size": settings.get("max_num_batched_tokens"),
        "page_size": settings.get("block_size"),
        "disable_radix_cache": settings.get("enable_prefix_caching") is False,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
        "nnodes": 1,
        "node_rank": 0,
        "enable_memory_saver": bool(settings.get("enable_memory_saver", False)),
    } | {k: settings[k] for k in ("host", "port") if k in settings}


def register(app: FastAPI, engine, model_name: str, settings: dict | None = None) -> None:
    settings = settings or {}

    async def model_info():
        path = str(getattr(engine, "path", settings.get("model", "")))
        info = {"model_path": path, "tokenizer_path": path, "is_generation": True}
        return info | {"preferred_sampling_params": None} | await _weight_version(engine)

    for path in ("/model_info", "/get_model_info"):  # SGLang 0.5's name, and the older one it keeps
        app.add_api_route(path, model_info, methods=["GET"])

    @app.get("/get_server_info")
    async def get_server_info():
        return server_args(engine, model_name, settings) | await _weight_version(engine)

    @app.get("/health_generate")
    async def health_generate():
        params = SamplingParams(max_tokens=1, ignore_eos=True, seed=0, detokenize=False)
        try:
            async for _ in engine.generate([0], params, f"health-{uuid.uuid4().hex}"):
                pass
        except (EngineDeadError, RuntimeError, ValueError) as e:
            return error_response(503, f"the engine did not generate: {e}", None, "server_error")
        return {}
