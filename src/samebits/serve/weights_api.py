"""SGLang's weight-sync and memory endpoints, over the engine process (`EngineProcess.call`).

Request bodies and `{"success", "message"}` answers are SGLang's, so a trainer written for
SGLang (slime, AReaL, verl's and OpenRLHF's SGLang paths) drives samebits unchanged:

- POST /init_weights_update_group, /destroy_weights_update_group
- POST /update_weights_from_distributed, /update_weights_from_tensor, /update_weights_from_disk
- POST /release_memory_occupation, /resume_memory_occupation, /flush_cache
- GET /get_weight_version: the `weight_version` the last successful update carried
- POST /weight_digests (samebits'): a digest of each named tensor, so a trainer can check a sync;
  POST /weight_specs (samebits'): each tensor's shape and dtype, so a client checks an update
  before it broadcasts anything.

Updates run between engine steps once nothing is in flight: running requests finish on the old
weights and new ones wait, unless `abort_all_requests` aborts the running ones (see
`engine.engine_child`). A refused update answers 400 with the reason naming the tensor; the old
weights keep serving. A broken connection halfway answers 500, same weights.

/update_weights_from_disk reads only under the allowed directories (`samebits serve
--allowed-weight-dirs`, default the model's own): the path's symlinks are resolved first.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, field_validator

from samebits.engine.async_engine import EngineDeadError

DEFAULT_GROUP = "weight_update_group"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 400, not ignored


class InitWeightsUpdateGroup(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"
    pp_rank: int = 0  # AReaL's, sent with pipeline-parallel engines

    @field_validator("pp_rank")
    @classmethod
    def _one_stage(cls, v: int) -> int:
        if v != 0:
            raise ValueError(f"is {v}; samebits serves the whole model in one pipeline stage, so only 0")
        return v


class DestroyWeightsUpdateGroup(_Body):
    group_name: str = DEFAULT_GROUP


class _Update(_Body):
    flush_cache: bool = True  # the prefix cache is always reset on an update (its K/V are stale)
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateFromDistributed(_Update):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP


class UpdateFromTensor(_Update):
    serialized_named_tensors: list[str]
    load_format: str | None = None


class UpdateFromDisk(_Update):
    model_path: str
    load_format: str | None = None


class MemoryTags(_Body):
    tags: list[str] | None = None


class Names(_Body):
    names: list[str] | None = None
    kind: str = "sha256"


def _answer(ok: bool, message: str, status: int = 200, **extra) -> JSONResponse:
    return JSONResponse({"success": ok, "message": message} | extra, status_code=status)


async def call(engine, method: str, **kwargs) -> tuple[int, object]:
    """`engine.call` -> (200, its value), or (status, message): 503 the engine died, 500 a
    connection broke halfway, 400 refused."""
    try:
        return 200, await engine.call(method, **kwargs)
    except EngineDeadError as e:
        return 503, str(e)
    except ConnectionError as e:
        return 500, str(e)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        return 400, str(e.args[0] if isinstance(e, KeyError) and e.args else e)


async def _run(engine, method: str, **kwargs) -> JSONResponse:
    status, value = await call(engine, method, **kwargs)
    if status != 200:
        return _answer(False, value, status)
    if isinstance(value, dict):
        return _answer(True, "", **value)
    return _answer(True, "" if value is None else str(value))


def outside_allowed(model_path: str, allowed: list | None) -> str | None:
    """Why `model_path` may not be read (None: it may): not under any allowed directory once
    every symlink of both is resolved. The engine is then given the resolved path, so a link
    swapped after the check does not move the read."""
    if allowed is None:
        return None
    real = Path(os.path.realpath(model_path))
    roots = [Path(os.path.realpath(d)) for d in allowed]
    if any(real.is_relative_to(r) for r in roots):
        return None
    shown = f"{model_path!r}" + (f" (resolved: {str(real)!r})" if str(real) != model_path else "")
    where = ", ".join(map(str, roots)) or "nothing"
    return f"model_path: {shown} is not under --allowed-weight-dirs ({where})"


def register(app: FastAPI, engine, allowed_weight_dirs: list | None = None) -> None:
    """Add the weight and memory routes for an engine with `call` (an EngineProcess);
    /update_weights_from_disk reads only under `allowed_weight_dirs` (None: anywhere)."""

    @app.post("/init_weights_update_group")
    async def init_group(body: InitWeightsUpdateGroup):
        return await _run(engine, "init_weights_update_group", **body.model_dump(exclude={"pp_rank"}))

    @app.post("/destroy_weights_update_group")
    async def destroy_group(body: DestroyWeightsUpdateGroup):
        return await _run(engine, "destroy_weights_update_group", **body.model_dump())

    @app.post("/update_weights_from_distributed")
    async def from_distributed(body: UpdateFromDistributed):
        return await _run(engine, "update_weights_from_distributed", **body.model_dump())

    @app.post("/update_weights_from_tensor")
    async def from_tensor(body: UpdateFromTensor):
        return await _run(engine, "update_weights_from_tensor", **body.model_dump())

    @app.post("/update_weights_from_disk")
    async def from_disk(body: UpdateFromDisk):
        kwargs = body.model_dump(exclude={"flush_cache", "load_format"})
        if body.load_format not in (None, "auto", "safetensors"):
            return _answer(False, f"load_format: {body.load_format!r} is not supported (safetensors only)", 400)
        refused = outside_allowed(body.model_path, allowed_weight_dirs)
        if refused:
            return _answer(False, refused, 400)
        if allowed_weight_dirs is not None:
            kwargs["model_path"] = os.path.realpath(body.model_path)
        return await _run(engine, "update_weights_from_disk", **kwargs)

    @app.post("/release_memory_occupation")
    async def release(body: MemoryTags | None = None):
        return await _run(engine, "release_memory_occupation", tags=body.tags if body else None)

    @app.post("/resume_memory_occupation")
    async def resume(body: MemoryTags | None = None):
        return await _run(engine, "resume_memory_occupation", tags=body.tags if body else None)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return await _run(engine, "flush_cache")

    @app.get("/get_weight_version")
    async def weight_version():
        return await _run(engine, "get_weight_version")

    @app.post("/weight_digests")
    async def weight_digests(body: Names):
        return await _run(engine, "weight_digests", names=body.names, kind=body.kind)

    @app.post("/weight_specs")
    async def weight_specs(body: Names | None = None):
        return await _run(engine, "weight_specs", names=body.names if body else None)
