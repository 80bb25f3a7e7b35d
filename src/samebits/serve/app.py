"""The FastAPI app: OpenAI-compatible and SGLang-style endpoints over one AsyncEngine.

Every request is checked in full (body, sampling params, prompt ids) before anything is
queued, so a bad one is a 400 with an OpenAI error body naming the field and nothing runs.
A prompt list becomes one engine request per prompt (`<id>-<i>`); `n` samples ride in
each. Streams end with the finish reason; a client that goes away aborts its requests.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from samebits.engine.async_engine import AsyncEngine, EngineDeadError
from samebits.engine.detokenizer import chat_prompt_ids
from samebits.serve import formats
from samebits.serve.metrics import make_registry, render
from samebits.serve.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    UnsupportedField,
)
from samebits.serve.streams import SSE_DONE, ClientGone, finals, merged, sse, unless_disconnected


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


@dataclass
class Ctx:
    """What shapes one response: token texts, top-k (None: no log-probs), token ids or not."""

    tok: formats.TokenText
    logprobs: int | None
    return_token_ids: bool


def _error(status: int, message: str, param: str | None, kind: str = "invalid_request_error") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _stream_error(e: Exception) -> str:
    """An error after the stream started: one event with an OpenAI error body."""
    code, kind = (503, "server_error") if isinstance(e, EngineDeadError) else (400, "invalid_request_error")
    return sse({"error": {"message": str(e), "type": kind, "param": None, "code": code}})


def _param_of(message: str, default: str) -> str:
    """The field a ValueError message names first ("request 0: top_p must ..." -> "top_p")."""
    text = message.split(": ", 1)[1] if message.startswith("request ") else message
    word = text.split(" ", 1)[0].strip(":,")
    return word if word.replace("_", "").isalnum() and word.islower() else default


def build_app(engine: AsyncEngine, model_name: str) -> FastAPI:
    """The HTTP face of `engine`, serving `model_name`."""
    app = FastAPI(title="samebits")
    registry = make_registry(engine.llm, engine)
    tok = formats.TokenText(engine.core.tokenizer)
    ids_tok = formats.TokenText(None)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param)

    @app.exception_handler(ApiError)
    async def _api_error(_, exc: ApiError):
        return _error(exc.status, exc.message, exc.param, exc.kind)

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            msg = f"model: the model {model!r} does not exist; this server has {model_name!r}"
            raise ApiError(404, msg, "model")

    def prepare(prompts: list, make_params, default_param: str) -> tuple:
        """-> (SamplingParams, prompt ids) after every check, or ApiError(400)."""
        try:
            params = make_params()
            ids = [engine.validate(i, p, params) for i, p in enumerate(prompts)]
        except UnsupportedField as e:
            raise ApiError(400, str(e), e.field) from e
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), _param_of(str(e), default_param)) from e
        return params, ids

    def start(ids: list[list[int]], params, rid: str) -> list:
        return [engine.generate(p, params, f"{rid}-{i}" if len(ids) > 1 else rid) for i, p in enumerate(ids)]

    async def respond(request: Request, gens: list, stream: bool, whole, chunks) -> Response:
        if stream:
            return StreamingResponse(chunks(merged(gens)), media_type="text/event-stream")
        try:
            outs = await unless_disconnected(request, finals(gens))
        except ClientGone:
            return Response(status_code=499)
        except EngineDeadError as e:
            return _error(503, str(e), None, "server_error")
        except ValueError as e:  # found by the engine thread (a request id already in flight)
            return _error(400, str(e), _param_of(str(e), "rid"))
        return JSONResponse(whole(outs))

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return _error(503, f"engine stopped: {engine.error!r}", None, "server_error")
        return {}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "samebits"}
        card["max_model_len"] = engine.llm.engine.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return Response(render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        if body.abort_all:
            engine.abort_all()
        elif body.rid:
            engine.abort(body.rid, group=True)
        else:
            raise ApiError(400, "rid: give the request id to abort, or abort_all: true", "rid")
        return {}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from e
        params, ids = prepare(prompts, lambda: body.to_params(body.max_tokens, body.logprobs), "prompt")
        ctx = Ctx(ids_tok if body.return_tokens_as_token_ids else tok, body.logprobs, body.return_token_ids)
        rid = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}

        def choice(i, o, c, part, text, finished):
            out = formats.completion_choice(i * params.n + c.index, c, part, text, finished, ctx)
            if body.return_token_ids and part.start == 0:
                out["prompt_token_ids"] = o.prompt_token_ids
            return out

        def whole(outs):
            every = slice(0, None)
            choices = [choice(i, o, c, every, c.text, True) for i, o in enumerate(outs) for c in o.outputs]
            return head | {"choices": choices, "usage": formats.usage(outs)}

        async def chunks(stream):
            yield_usage, last = body.include_usage(), {}
            state = formats.StreamState()
            try:
                async for i, o in stream:
                    last[i] = o
                    for c in o.outputs:
                        new = state.new_part(i, c)
                        if new:
                            yield sse(head | {"choices": [choice(i, o, c, *new)]})
            except (EngineDeadError, ValueError) as e:
                yield _stream_error(e)
                return
            if yield_usage:
                yield sse(head | {"choices": [], "usage": formats.usage(list(last.values()))})
            yield SSE_DONE

        return await respond(request, start(ids, params, rid), body.stream, whole, chunks)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        try:
            prompt = chat_prompt_ids(engine.core.tokenizer, [m.as_template_input() for m in body.messages])
            k = body.logprobs_k()
        except ValueError as e:
            raise ApiError(400, str(e), _param_of(str(e), "messages")) from e
        params, ids = prepare([prompt], lambda: body.to_params(body.max_new(), k), "messages")
        ctx = Ctx(ids_tok if body.return_tokens_as_token_ids else tok, k, body.return_token_ids)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "created": int(time.time()), "model": model_name}

        def choice(o, c, part, text, finished, delta):
            out = formats.chat_choice(c.index, c, part, text, finished, ctx, delta)
            if body.return_token_ids and part.start == 0:
                out["prompt_token_ids"] = o.prompt_token_ids
            return out

        def whole(outs):
            choices = [choice(outs[0], c, slice(0, None), c.text, True, False) for c in outs[0].outputs]
            return head | {"object": "chat.completion", "choices": choices, "usage": formats.usage(outs)}

        async def chunks(stream):
            state, last = formats.StreamState(), None
            try:
                async for i, o in stream:
                    last = o
                    for c in o.outputs:
                        new = state.new_part(i, c)
                        if new:
                            chunk = {"object": "chat.completion.chunk", "choices": [choice(o, c, *new, True)]}
                            yield sse(head | chunk)
            except (EngineDeadError, ValueError) as e:
                yield _stream_error(e)
                return
            if body.include_usage() and last is not None:
                tail = {"object": "chat.completion.chunk", "choices": [], "usage": formats.usage([last])}
                yield sse(head | tail)
            yield SSE_DONE

        return await respond(request, start(ids, params, rid), body.stream, whole, chunks)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        try:
            prompt = body.prompt()
        except ValueError as e:
            raise ApiError(400, str(e), "text") from e
        params, ids = prepare([prompt], body.to_params, "sampling_params")
        rid = body.rid or uuid.uuid4().hex
        k = body.top_logprobs_num

        def shape(o):
            outs = [formats.sglang_output(o, c, body.return_logprob, k) for c in o.outputs]
            return outs[0] if len(outs) == 1 else outs

        async def chunks(stream):
            try:
                async for _, o in stream:
                    yield sse(shape(o))
            except (EngineDeadError, ValueError) as e:
                yield _stream_error(e)
                return
            yield SSE_DONE

        return await respond(request, start(ids, params, rid), body.stream, lambda outs: shape(outs[0]), chunks)

    return app
