"""What one request may ask of the server, refused before any work with the limit's option named.

- body bytes (`--max-body-bytes`): 413, checked on `Content-Length` before the body is read,
  and on the bytes as they arrive for a chunked body (a pure ASGI middleware);
- `n` (`--max-n`), `max_tokens` (`--max-tokens-limit`), top log-probs (`--max-top-logprobs`),
  stop strings (`--max-stop-strings`, `--max-stop-string-chars`): 400 naming the field;
- prompt tokens: prompt + max_tokens <= `--max-model-len` (the engine's check, 400);
- engine streams open at once (`--max-concurrent-streams`; one per prompt of a request,
  streamed or not): 429 for the request that would pass it.

Each refusal is counted in /metrics as `samebits_limit_refused_total{limit}`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from samebits.requests.sampling_params import MAX_LOGPROBS, MAX_N
from samebits.serve.errors import ApiError, error_response


@dataclass(frozen=True)
class Limits:
    """Per-request bounds of one server (the `samebits serve` options of the same names)."""

    max_body_bytes: int = 64 * 1024 * 1024
    max_n: int = MAX_N
    max_tokens: int | None = None  # None: only prompt + max_tokens <= max_model_len
    max_top_logprobs: int = MAX_LOGPROBS
    max_stop_strings: int = 16
    max_stop_string_chars: int = 512
    max_concurrent_streams: int = 1024

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_n > MAX_N:
            raise ValueError(f"max_n must be <= {MAX_N} (the engine's limit), got {self.max_n}")
        if self.max_top_logprobs > MAX_LOGPROBS:
            raise ValueError(f"max_top_logprobs must be <= {MAX_LOGPROBS}, got {self.max_top_logprobs}")


class LimitCounter:
    """`samebits_limit_refused_total{limit}`."""

    def __init__(self, registry: CollectorRegistry):
        doc = "requests refused by a limit (400, 413, 429)"
        self.counter = Counter("samebits_limit_refused", doc, ["limit"], registry=registry)

    def refuse(self, status: int, limit: str, option: str, message: str, param: str | None) -> ApiError:
        self.counter.labels(limit).inc()
        return ApiError(status, f"{message} (limit: {option})", param)


def check_params(limits: Limits, params, refused: LimitCounter) -> None:
    """ApiError for sampling params over a limit (n, max_tokens, top log-probs, stop strings)."""
    if params.n > limits.max_n:
        raise refused.refuse(400, "n", "--max-n", f"n: {params.n} is over {limits.max_n}", "n")
    if limits.max_tokens is not None and params.max_tokens > limits.max_tokens:
        msg = f"max_tokens: {params.max_tokens} is over {limits.max_tokens}"
        raise refused.refuse(400, "max_tokens", "--max-tokens-limit", msg, "max_tokens")
    if params.logprobs is not None and params.logprobs > limits.max_top_logprobs:
        msg = f"logprobs: {params.logprobs} top log-probs is over {limits.max_top_logprobs}"
        raise refused.refuse(400, "top_logprobs", "--max-top-logprobs", msg, "logprobs")
    stops = params.stop or ()
    if len(stops) > limits.max_stop_strings:
        msg = f"stop: {len(stops)} stop strings is over {limits.max_stop_strings}"
        raise refused.refuse(400, "stop_strings", "--max-stop-strings", msg, "stop")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_string_chars:
        msg = f"stop: a stop string of {longest} characters is over {limits.max_stop_string_chars}"
        raise refused.refuse(400, "stop_string_chars", "--max-stop-string-chars", msg, "stop")


# the engine's own range checks that are also the default limits: (param, limit, option)
ENGINE_BOUNDS = {"n": ("n", "--max-n"), "logprobs": ("top_logprobs", "--max-top-logprobs")}


def engine_bound(param: str, message: str, refused: LimitCounter) -> str:
    """`message` of the engine's range check on `param`, with the limit's option when it is one."""
    if param not in ENGINE_BOUNDS or "must be" not in message:
        return message
    limit, option = ENGINE_BOUNDS[param]
    refused.counter.labels(limit).inc()
    return f"{message} (limit: {option})"


class StreamSlots:
    """Engine streams open at once, bounded by `--max-concurrent-streams`."""

    def __init__(self, limit: int, refused: LimitCounter):
        self.limit, self.refused, self.open = limit, refused, 0

    def take(self, count: int):
        """Reserve `count` streams -> a release function (idempotent), or ApiError(429)."""
        if self.open + count > self.limit:
            msg = f"{self.open} engine streams are open; {count} more would pass {self.limit}: retry later"
            raise self.refused.refuse(429, "concurrent_streams", "--max-concurrent-streams", msg, None)
        self.open += count
        done = [False]

        def release() -> None:
            if not done[0]:
                done[0] = True
                self.open -= count

        return release

    @staticmethod
    def on_collect(obj, release) -> None:
        """Release when `obj` (a response's body iterator) is collected, in case its `finally`
        never runs (a client gone before the stream started)."""
        weakref.finalize(obj, release)


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes: at once from `Content-Length`, else when the bytes
    that arrived pass it (the app has not seen any of them: the body is held until complete)."""

    def __init__(self, app: ASGIApp, limit: int, refused: LimitCounter):
        self.app, self.limit, self.refused = app, limit, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None and length > self.limit:
            return await self._refuse(scope, receive, send, f"{length} bytes")
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body was complete
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await self._refuse(scope, receive, send, f"over {size} bytes")
        await self.app(scope, _replay(b"".join(body), receive), send)

    async def _refuse(self, scope, receive, send, what: str) -> None:
        self.refused.counter.labels("body_bytes").inc()
        msg = f"body: {what} is over {self.limit} bytes (limit: --max-body-bytes)"
        response = error_response(413, msg, None)
        response.headers["Connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then the real channel: http.disconnect

    return replayed


def _content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None
