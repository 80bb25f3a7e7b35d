"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from starlette.responses import JSONResponse

from samebits.engine.async_engine import EngineDeadError
from samebits.serve.streams import sse


class ApiError(Exception):
    """An error answered with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, param: str | None, kind: str = "invalid_request_error"):
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def stream_error(e: Exception) -> str:
    """An error after the stream started: one event with an OpenAI error body."""
    code, kind = (503, "server_error") if isinstance(e, EngineDeadError) else (400, "invalid_request_error")
    return sse({"error": {"message": str(e), "type": kind, "param": None, "code": code}})


def param_of(message: str, default: str) -> str:
    """The field a ValueError message names first ("request 0: top_p must ..." -> "top_p")."""
    text = message.split(": ", 1)[1] if message.startswith("request ") else message
    word = text.split(" ", 1)[0].strip(":,")
    return word if word.replace("_", "").isalnum() and word.islower() else default
