"""API keys: `Authorization: Bearer <key>` on every endpoint but /health and /metrics.

Two levels, as SGLang has them (`--api-key`, `--admin-api-key`):

- inference (`/v1/*`, `/generate`, `/abort_request` of one id, `/get_weight_version`, and any
  path not listed below): an API key or the admin key;
- admin (everything that changes or reveals the model or the server's state: weight updates,
  groups, memory release and resume, `/flush_cache`, `/weight_digests`, `/weight_specs`,
  SGLang's `/pause_generation` and `/continue_generation`, vLLM's
  `/server_info`, `/reset_prefix_cache` and weight-transfer endpoints, SGLang's
  `/get_server_info`, and
  `/abort_request` with `abort_all`, which `app.py` checks on the body): the admin key, or the
  API key when no admin key is set.

A level with no key set is open. The check is a pure ASGI middleware, so it runs before the
body is read and never wraps a stream. Keys are compared as their SHA-256 digests with
`hmac.compare_digest`, against every key (no early exit), so the time does not depend on how
much of a key matched. A refusal is a 401 with an OpenAI error body, counted in /metrics as
`samebits_auth_refused_total{level}`.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Receive, Scope, Send

from samebits.serve.errors import error_response

OPEN = frozenset({"/health", "/metrics"})
ADMIN = frozenset(
    {
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/flush_cache",
        "/weight_digests",
        "/weight_specs",
        "/pause_generation",
        "/continue_generation",
        # vLLM's (TRL's VLLMClient): the server's config, its prefix cache, its weight transfer
        "/server_info",
        "/get_server_info",
        "/reset_prefix_cache",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    }
)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _matches(token: bytes, keys: tuple[bytes, ...]) -> bool:
    found = False
    for k in keys:  # every key, no early exit
        found |= hmac.compare_digest(token, k)
    return found


@dataclass(frozen=True)
class Keys:
    """The server's keys (SHA-256 digests); empty tuples: that level is open."""

    api: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, api_keys=(), admin_keys=()) -> Keys:
        """From the plain keys (`--api-key`, `--admin-api-key`); empty strings are refused."""
        for option, keys in (("--api-key", api_keys), ("--admin-api-key", admin_keys)):
            if any(not isinstance(k, str) or not k for k in keys):
                raise ValueError(f"{option}: a key must be a non-empty string")
        return cls(tuple(map(_digest, api_keys)), tuple(map(_digest, admin_keys)))

    @property
    def admin_guarded(self) -> bool:
        """Whether the admin endpoints need a key (the admin key, or the API key in its place)."""
        return bool(self.admin or self.api)

    def allows(self, level: str, authorization: str | None) -> bool:
        """Whether `Authorization: <authorization>` opens an endpoint of `level` ("api"/"admin")."""
        admin = self.admin or self.api  # with no admin key, the API key guards the admin endpoints
        wanted = admin if level == "admin" else (self.api + self.admin if self.api else ())
        if not wanted:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            _matches(_digest(""), wanted)  # the same work as a wrong key
            return False
        return _matches(_digest(token.strip()), wanted)


def level_of(path: str) -> str | None:
    """The key level a path needs: None (open), "api" or "admin"."""
    if path in OPEN:
        return None
    return "admin" if path in ADMIN else "api"


def refused_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "samebits_auth_refused",
        "requests refused for a missing or wrong API key (401)",
        ["level"],
        registry=registry,
    )


def refusal(level: str):
    """The 401 answer: an OpenAI error body, and `WWW-Authenticate: Bearer`."""
    which = "the admin key (--admin-api-key)" if level == "admin" else "an API key (--api-key)"
    message = f"missing or wrong API key: this endpoint needs {which} as 'Authorization: Bearer <key>'"
    response = error_response(401, message, None, "authentication_error")
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


class AuthMiddleware:
    """Refuse a request without the key its path needs, before anything reads its body."""

    def __init__(self, app: ASGIApp, keys: Keys, refused: Counter):
        self.app, self.keys, self.refused = app, keys, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        level = level_of(scope["path"])
        if level is not None and not self.keys.allows(level, _header(scope, b"authorization")):
            self.refused.labels(level).inc()
            return await refusal(level)(scope, receive, send)
        return await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None
