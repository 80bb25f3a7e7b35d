"""The FastAPI app: OpenAI-compatible and SGLang-style endpoints over one AsyncEngine.

Keys (`auth.py`) and the body size (`limits.py`) are checked before the body is read. Every
request is then checked in full (body, sampling params and their limits, prompt ids) before
anything is queued, so a bad one is a 400 with an OpenAI error body naming the field and
nothing runs.
A prompt list becomes one engine request per prompt (`<id>-<i>`); `n` samples ride in
each. Streams end with the finish reason; a client that goes away aborts its requests.
The generation endpoints themselves are in `handlers.py`.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from samebits.engine.async_engine import AsyncEngine, EngineDeadError
from samebits.engine.engine_process import EngineProcess
from samebits.serve import formats, handlers, pause, sglang_api, vllm_api, weights_api
from samebits.serve import limits as limits_
from samebits.serve.auth import AuthMiddleware, Keys, refusal, refused_counter
from samebits.serve.errors import ApiError, error_response, param_of
from samebits.serve.limits import BodyLimitMiddleware, LimitCounter, Limits, StreamSlots
from samebits.serve.metrics import make_registry, render
from samebits.serve.protocol import AbortRequest, UnsupportedField
from samebits.serve.streams import ClientGone, finals, merged, unless_disconnected


class Service:
    """What every endpoint shares: the engine, the model's name, token texts."""

    def __init__(self, engine: AsyncEngine | EngineProcess, model_name: str, limits: Limits, refused):
        self.engine = engine
        self.model_name = model_name
        self.limits, self.refused = limits, refused
        self.slots = StreamSlots(limits.max_concurrent_streams, refused)
        self.pause = pause.Pause(engine)  # SGLang's /pause_generation holds new streams here
        self.tok = formats.TokenText(engine.tokenizer)
        self.ids_tok = formats.TokenText(None)  # "token_id:<id>" (return_tokens_as_token_ids)
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            msg = f"model: the model {model!r} does not exist; this server has {self.model_name!r}"
            raise ApiError(404, msg, "model")

    def prepare(self, prompts: list, make_params, default_param: str) -> tuple:
        """-> (SamplingParams, prompt ids) after every check, or ApiError(400)."""
        try:
            params = make_params()
            limits_.check_params(self.limits, params, self.refused)
            ids = [self.engine.validate(i, p, params) for i, p in enumerate(prompts)]
        except UnsupportedField as e:
            raise ApiError(400, str(e), e.field) from e
        except (ValueError, TypeError) as e:
            message, param = str(e), param_of(str(e), default_param)
            if "exceeds max_model_len" in message:  # the prompt-token limit
                self.refused.counter.labels("prompt_tokens").inc()
                message += " (limit: --max-model-len)"
            raise ApiError(400, limits_.engine_bound(param, message, self.refused), param) from e
        return params, ids

    def start(self, ids: list[list[int]], params, rid: str) -> list:
        """One engine stream per prompt (not started until iterated, nor while paused)."""
        gen, held = self.engine.generate, self.pause.held
        return [held(gen(p, params, f"{rid}-{i}" if len(ids) > 1 else rid)) for i, p in enumerate(ids)]

    async def respond(self, request: Request, gens: list, stream: bool, whole, chunks) -> Response:
        """A stream of SSE events, or the whole JSON once every prompt finished. 429 when the
        streams would pass --max-concurrent-streams."""
        release = self.slots.take(len(gens))
        if stream:
            body = _released(chunks(merged(gens)), release)
            self.slots.on_collect(body, release)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            outs = await unless_disconnected(request, finals(gens))
        except ClientGone:
            return Response(status_code=499)
        except EngineDeadError as e:
            return error_response(503, str(e), None, "server_error")
        except ValueError as e:  # found by the engine thread (a request id already in flight)
            return error_response(400, str(e), param_of(str(e), "rid"))
        finally:
            release()
        return JSONResponse(whole(outs))


async def _released(events, release):
    """`events`, then `release()` however the stream ends."""
    try:
        async for event in events:
            yield event
    finally:
        release()


def build_app(
    engine: AsyncEngine | EngineProcess,
    model_name: str,
    keys: Keys | None = None,
    limits: Limits | None = None,
    allowed_weight_dirs: list | None = None,
    settings: dict | None = None,
) -> FastAPI:
    """The HTTP face of `engine`, serving `model_name`. `keys`: none by default (open);
    `limits`: `Limits()`'s defaults; `allowed_weight_dirs`: where /update_weights_from_disk
    may read (None: anywhere, for library use; `samebits serve` passes the model's dir);
    `settings`: what the engine was built with (`LLM`'s keyword arguments), for /server_info."""
    keys, limits = keys or Keys(), limits or Limits()
    app = FastAPI(title="samebits")
    registry = make_registry(engine)
    refused_keys, refused = refused_counter(registry), LimitCounter(registry)
    svc = Service(engine, model_name, limits, refused)
    app.add_middleware(BodyLimitMiddleware, limit=limits.max_body_bytes, refused=refused)
    app.add_middleware(AuthMiddleware, keys=keys, refused=refused_keys)  # added last: runs first

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_, exc: RequestValidationError):
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param)

    @app.exception_handler(ApiError)
    async def _api_error(_, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.kind)

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return error_response(503, f"engine stopped: {engine.error!r}", None, "server_error")
        return {}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": svc.created, "owned_by": "samebits"}
        return {"object": "list", "data": [card | {"max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest, request: Request):
        if body.abort_all:
            if not keys.allows("admin", request.headers.get("authorization")):
                refused_keys.labels("admin").inc()
                return refusal("admin")
            engine.abort_all()
        elif body.rid:
            engine.abort(body.rid, group=True)
        else:
            raise ApiError(400, "rid: give the request id to abort, or abort_all: true", "rid")
        return {}

    handlers.register(app, svc)
    vllm_api.register(app, engine, model_name, settings)  # what TRL's VLLMClient asks of vLLM
    sglang_api.register(app, engine, model_name, settings)  # what slime, AReaL read of SGLang
    pause.register(app, svc.pause)  # AReaL's pause around each weight update
    if hasattr(engine, "call"):  # the engine process: weight sync and memory (SGLang's endpoints)
        weights_api.register(app, engine, allowed_weight_dirs)
    return app
