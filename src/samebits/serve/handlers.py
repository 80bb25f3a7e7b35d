"""The generation endpoints: OpenAI /v1/completions and /v1/chat/completions, SGLang /generate."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request

from samebits.engine.async_engine import EngineDeadError
from samebits.engine.detokenizer import chat_prompt_ids
from samebits.serve import formats
from samebits.serve.errors import ApiError, param_of, stream_error
from samebits.serve.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from samebits.serve.streams import SSE_DONE, sse


def register(app: FastAPI, svc) -> None:
    """Add the three generation routes, bound to `svc` (an app.Service)."""

    @app.post("/v1/completions")
    async def _completions(body: CompletionRequest, request: Request):
        return await completions(svc, body, request)

    @app.post("/v1/chat/completions")
    async def _chat(body: ChatCompletionRequest, request: Request):
        return await chat(svc, body, request)

    @app.post("/generate")
    async def _generate(body: GenerateRequest, request: Request):
        return await generate(svc, body, request)


async def openai_chunks(stream, chunk: Callable, usage_tail: Callable | None) -> AsyncIterator[str]:
    """SSE events of an OpenAI stream: `chunk(i, output, sample, part, text, finished)` for each
    new piece of a sample, then `usage_tail(last outputs)` when asked, then [DONE]."""
    state, last = formats.StreamState(), {}
    try:
        async for i, o in stream:
            last[i] = o
            for c in o.outputs:
                new = state.new_part(i, c)
                if new:
                    yield sse(chunk(i, o, c, *new))
    except (EngineDeadError, ValueError) as e:
        yield stream_error(e)
        return
    if usage_tail is not None:
        yield sse(usage_tail(list(last.values())))
    yield SSE_DONE


def _ctx(svc, body, k: int | None) -> formats.Ctx:
    tok = svc.ids_tok if body.return_tokens_as_token_ids else svc.tok
    return formats.Ctx(tok, k, body.return_token_ids)


async def completions(svc, body: CompletionRequest, request: Request):
    svc.check_model(body.model)
    try:
        prompts = body.prompts()
    except ValueError as e:
        raise ApiError(400, str(e), "prompt") from e
    params, ids = svc.prepare(prompts, lambda: body.to_params(body.max_tokens, body.logprobs), "prompt")
    ctx = _ctx(svc, body, body.logprobs)
    rid = f"cmpl-{uuid.uuid4().hex}"
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": svc.model_name}

    def choice(i, o, c, part, text, finished):
        return formats.completion_choice(i * params.n + c.index, o, c, part, text, finished, ctx)

    def whole(outs):
        every = slice(0, None)
        choices = [choice(i, o, c, every, c.text, True) for i, o in enumerate(outs) for c in o.outputs]
        return head | {"choices": choices, "usage": formats.usage(outs)}

    def chunks(stream):
        tail = (
            (lambda outs: head | {"choices": [], "usage": formats.usage(outs)})
            if body.include_usage()
            else None
        )
        return openai_chunks(stream, lambda *a: head | {"choices": [choice(*a)]}, tail)

    return await svc.respond(request, svc.start(ids, params, rid), body.stream, whole, chunks)


async def chat(svc, body: ChatCompletionRequest, request: Request):
    svc.check_model(body.model)
    try:
        prompt = chat_prompt_ids(svc.engine.tokenizer, [m.as_template_input() for m in body.messages])
        k = body.logprobs_k()
    except ValueError as e:
        raise ApiError(400, str(e), param_of(str(e), "messages")) from e
    params, ids = svc.prepare([prompt], lambda: body.to_params(body.max_new(), k), "messages")
    ctx = _ctx(svc, body, k)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    head = {"id": rid, "created": int(time.time()), "model": svc.model_name}
    chunk_head = head | {"object": "chat.completion.chunk"}

    def whole(outs):
        o, every = outs[0], slice(0, None)
        choices = [formats.chat_choice(o, c, every, c.text, True, ctx, delta=False) for c in o.outputs]
        body = head | {"object": "chat.completion", "choices": choices, "usage": formats.usage(outs)}
        if ctx.return_token_ids:  # vLLM's place for them in chat (each choice has them too)
            body["prompt_token_ids"] = o.prompt_token_ids
        if o.prompt_logprobs is not None:  # vLLM's place in chat: the response, not a choice
            body["prompt_logprobs"] = formats.prompt_logprobs(o, ctx.tok)
        return body

    def chunks(stream):
        def piece(_, o, c, part, text, finished):
            out = chunk_head | {"choices": [formats.chat_choice(o, c, part, text, finished, ctx, delta=True)]}
            if o.prompt_logprobs is not None and part.start == 0:  # a sample's first piece, as whole
                out["prompt_logprobs"] = formats.prompt_logprobs(o, ctx.tok)
            return out

        tail = (
            (lambda outs: chunk_head | {"choices": [], "usage": formats.usage(outs)})
            if body.include_usage()
            else None
        )
        return openai_chunks(stream, piece, tail)

    return await svc.respond(request, svc.start(ids, params, rid), body.stream, whole, chunks)


async def generate(svc, body: GenerateRequest, request: Request):
    try:
        prompt = body.prompt()
    except ValueError as e:
        raise ApiError(400, str(e), "text") from e
    params, ids = svc.prepare([prompt], body.to_params, "sampling_params")
    if body.scores_prompt() and body.logprob_start_len >= len(ids[0]):
        why = f"logprob_start_len {body.logprob_start_len} must be below the prompt's {len(ids[0])} tokens"
        raise ApiError(400, why, "logprob_start_len")
    rid = body.rid or uuid.uuid4().hex

    start = body.logprob_start_len if body.scores_prompt() else -1

    def shape(o):
        o = formats.sglang_scores_only(o) if body.scores_only() else o
        k = body.top_logprobs_num
        inputs = None if start < 0 or o.prompt_logprobs is None else formats.sglang_input_logprobs(o, start, k)
        outs = [formats.sglang_output(o, c, body.return_logprob, k, inputs) for c in o.outputs]
        return outs[0] if len(outs) == 1 else outs

    async def chunks(stream):  # SGLang streams the cumulative object; the last one is the whole
        try:
            async for _, o in stream:
                yield sse(shape(o))
        except (EngineDeadError, ValueError) as e:
            yield stream_error(e)
            return
        yield SSE_DONE

    return await svc.respond(
        request, svc.start(ids, params, rid), body.stream, lambda outs: shape(outs[0]), chunks
    )
