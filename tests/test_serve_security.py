"""Keys, limits and the weight directory of `samebits serve`, each refusal with its control.

Most claims run in process against the real app over a stub engine that records every call
it gets (so "refused before any work" is checked: the stub saw nothing), and the same request
to an app without keys or with wider limits is accepted (so the refusal is the key's or the
limit's doing). The CLI's own checks (the non-loopback refusal, $VLLM_API_KEY, the default
weight directory, the openai client and `samebits.client.Client` sending the key) run against
a `samebits serve` subprocess on 127.0.0.1, stopped by its PID.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from serve_server import Server

from samebits.client import Client, WeightSyncError
from samebits.engine.outputs import CompletionOutput, RequestOutput
from samebits.engine.validation import check_request
from samebits.serve import auth
from samebits.serve.app import build_app
from samebits.serve.auth import Keys
from samebits.serve.limits import Limits
from samebits.serve.metrics import COUNTERS, GAUGES

API, ADMIN = "api-key-1", "admin-key-1"
COMPLETION = ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
INFERENCE = [
    ("GET", "/v1/models", None),
    ("POST", *COMPLETION),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/abort_request", {"rid": "nobody"}),
    ("GET", "/get_weight_version", None),
]
ADMIN_CALLS = [
    (
        "POST",
        "/init_weights_update_group",
        {"master_address": "x", "master_port": 1, "rank_offset": 1, "world_size": 2},
    ),
    ("POST", "/destroy_weights_update_group", {}),
    ("POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": []}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nowhere"}),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/resume_memory_occupation", {}),
    ("POST", "/flush_cache", None),
    ("GET", "/flush_cache", None),
    ("POST", "/pause_generation", {}),
    ("POST", "/continue_generation", {}),
    ("POST", "/weight_digests", {}),
    ("POST", "/weight_specs", {}),
    ("POST", "/abort_request", {"abort_all": True}),
]


class StubEngine:
    """What the app asks of an EngineProcess; every call that would do work is recorded."""

    tokenizer, max_model_len, error, vocab = None, 64, None, 100

    def __init__(self):
        self.work: list[str] = []

    def metrics(self) -> dict:
        return dict.fromkeys([*GAUGES, *COUNTERS], 0)

    def validate(self, i, prompt, params):
        return check_request(i, prompt, params, self.max_model_len, self.vocab, lambda i, t: [1] * len(t))

    async def generate(self, prompt, params, request_id=None):
        self.work.append("generate")
        k, t = params.logprobs, params.max_tokens
        top = [[(7, 0.0)] * k for _ in range(t)] if k else None
        outs = [CompletionOutput(j, [7] * t, torch.zeros(t), "", "length", top) for j in range(params.n)]
        yield RequestOutput(0, list(prompt), outs[0].token_ids, outs[0].logprobs, "length", outputs=outs)

    def abort(self, rid, group=False):
        self.work.append("abort")

    def abort_all(self):
        self.work.append("abort_all")

    def num_in_flight(self) -> int:
        return 0

    async def call(self, method, **kwargs):
        self.work.append(method)
        return {"weight_version": "default"} if method == "get_weight_version" else None


def _app(keys=None, limits=None, dirs=None):
    engine = StubEngine()
    return TestClient(build_app(engine, "stub", keys, limits, dirs)), engine


def _send(client, method, path, body, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.request(method, path, json=body, headers=headers)


def _refused(client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(("samebits_auth_refused_total", "samebits_limit_refused_total")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# -- keys -----------------------------------------------------------------------------------------


def _is_admin(call) -> bool:
    return call[1] in auth.ADMIN or call[2] == {"abort_all": True}


@pytest.mark.parametrize("call", INFERENCE + ADMIN_CALLS, ids=lambda c: f"{c[0]} {c[1]} {c[2] or ''}"[:60])
def test_every_endpoint_refuses_a_missing_or_wrong_key_before_work_and_the_keyless_control_serves(call):
    keyed, engine = _app(Keys.of([API], [ADMIN]))
    for key in (None, "wrong", API + "x", API[:-1], ADMIN[:-1]):
        r = _send(keyed, *call, key=key)
        assert r.status_code == 401, (key, r.text)
        error = r.json()["error"]
        assert (
            error["code"] == 401 and "Bearer" in error["message"] and r.headers["www-authenticate"] == "Bearer"
        )
    assert engine.work == []  # refused before any work
    open_app, open_engine = _app()  # control: no keys, the same request gets the same answer
    want = _send(open_app, *call)
    assert want.status_code != 401
    assert _send(keyed, *call, key=ADMIN).status_code == want.status_code  # the admin key opens all
    assert engine.work == open_engine.work
    api = _send(keyed, *call, key=API)  # an API key opens inference only
    assert api.status_code == (401 if _is_admin(call) else want.status_code)


@pytest.mark.parametrize("call", ADMIN_CALLS, ids=lambda c: f"{c[0]} {c[1]}")
def test_the_api_key_does_not_open_admin_endpoints_when_an_admin_key_is_set(call):
    keyed, engine = _app(Keys.of([API], [ADMIN]))
    assert _send(keyed, *call, key=API).status_code == 401
    assert engine.work == []


@pytest.mark.parametrize("call", [INFERENCE[1], ADMIN_CALLS[-2]], ids=["inference", "admin"])
def test_with_only_an_api_key_the_admin_endpoints_take_it(call):
    keyed, _ = _app(Keys.of([API, "second"]))
    assert _send(keyed, *call).status_code == 401
    assert _send(keyed, *call, key=API).status_code == 200
    assert _send(keyed, *call, key="second").status_code == 200  # several keys: any of them


def test_with_only_an_admin_key_inference_is_open_and_admin_is_not():
    keyed, _ = _app(Keys.of([], [ADMIN]))
    assert _send(keyed, *INFERENCE[1]).status_code == 200
    assert _send(keyed, *ADMIN_CALLS[-2]).status_code == 401
    assert _send(keyed, *ADMIN_CALLS[-2], key=ADMIN).status_code == 200


def test_health_and_metrics_stay_open_and_refusals_are_counted():
    keyed, _ = _app(Keys.of([API], [ADMIN]))
    assert keyed.get("/health").status_code == 200
    for _ in range(3):
        _send(keyed, *INFERENCE[1])
    _send(keyed, *ADMIN_CALLS[-1], key=API)
    counts = _refused(keyed)
    assert counts['samebits_auth_refused_total{level="api"}'] == 3
    assert counts['samebits_auth_refused_total{level="admin"}'] == 1


def test_keys_compare_by_digest_in_constant_time(monkeypatch):
    """Every key is compared, through hmac.compare_digest of equal-length SHA-256 digests."""
    seen = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: seen.append((len(a), len(b))) or real(a, b))
    keys = Keys.of(["a", "bb", "ccc"], [])
    assert keys.allows("api", "Bearer a") and not keys.allows("api", "Bearer abc")
    assert not keys.allows("api", None)
    assert seen == [(32, 32)] * 9
    with pytest.raises(ValueError, match="--api-key"):
        Keys.of([""], [])


# -- limits ---------------------------------------------------------------------------------------

LIMITED = Limits(max_n=2, max_tokens=4, max_top_logprobs=2, max_stop_strings=2, max_stop_string_chars=3)
OVER = [  # (body of /v1/completions, status, the option the refusal names)
    ({"prompt": [1], "max_tokens": 2, "n": 3}, 400, "--max-n"),
    ({"prompt": [1], "max_tokens": 5}, 400, "--max-tokens-limit"),
    ({"prompt": [1], "max_tokens": 2, "logprobs": 3}, 400, "--max-top-logprobs"),
    ({"prompt": [1], "max_tokens": 2, "stop": ["a", "b", "c"]}, 400, "--max-stop-strings"),
    ({"prompt": [1], "max_tokens": 2, "stop": ["abcd"]}, 400, "--max-stop-string-chars"),
    ({"prompt": [1] * 63, "max_tokens": 2}, 400, "--max-model-len"),
]


@pytest.mark.parametrize("body,status,option", OVER, ids=[o for *_, o in OVER])
def test_a_request_over_a_limit_is_refused_before_work_naming_the_option(body, status, option):
    limited, engine = _app(limits=LIMITED)
    r = limited.post("/v1/completions", json=body)
    assert r.status_code == status and option in r.json()["error"]["message"], r.text
    assert engine.work == []
    assert sum(_refused(limited).values()) == 1
    if option != "--max-model-len":  # control: the default limits serve it
        wide, wide_engine = _app()
        assert wide.post("/v1/completions", json=body).status_code == 200 and wide_engine.work


def test_the_engines_own_bounds_name_the_option_too():
    default, engine = _app()
    r = default.post("/v1/completions", json={"prompt": [1], "max_tokens": 2, "n": 129})
    assert r.status_code == 400 and "--max-n" in r.json()["error"]["message"] and engine.work == []
    with pytest.raises(ValueError, match="max_n must be <= 128"):
        Limits(max_n=129)


def test_a_body_over_max_body_bytes_is_413_by_length_and_by_chunks():
    limited, engine = _app(limits=Limits(max_body_bytes=1000))
    body = b'{"prompt": [' + b"1," * 600 + b'1], "max_tokens": 2}'
    r = limited.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the bytes are counted as they come
        for i in range(0, len(body), 100):
            yield body[i : i + 100]

    r = limited.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and engine.work == []
    assert _refused(limited)['samebits_limit_refused_total{limit="body_bytes"}'] == 2
    small = b'{"prompt": [1, 2], "max_tokens": 2}'
    assert (
        limited.post("/v1/completions", content=small, headers={"content-type": "application/json"}).status_code
        == 200
    )


def test_concurrent_streams_over_the_limit_get_429_and_are_given_back():
    limited, engine = _app(limits=Limits(max_concurrent_streams=3))
    four = {"prompt": [[1], [2], [3], [4]], "max_tokens": 2}
    r = limited.post("/v1/completions", json=four)
    assert r.status_code == 429 and "--max-concurrent-streams" in r.json()["error"]["message"]
    assert engine.work == []
    for _ in range(5):  # three at a time, each given back when its response is done
        assert limited.post("/v1/completions", json=four | {"prompt": [[1], [2], [3]]}).status_code == 200
        with limited.stream(
            "POST", "/v1/completions", json=four | {"prompt": [[1], [2], [3]], "stream": True}
        ) as s:
            assert s.status_code == 200 and "data: [DONE]" in list(s.iter_lines())
    assert len(engine.work) == 30  # ten responses of three streams each, never four at once


# -- the weight directory -------------------------------------------------------------------------


def test_disk_reload_only_under_the_allowed_dirs_symlinks_resolved(tmp_path):
    allowed, other = tmp_path / "ckpts", tmp_path / "secret"
    (allowed / "run1").mkdir(parents=True)
    other.mkdir()
    (allowed / "link").symlink_to(other)
    app, engine = _app(dirs=[allowed])
    for path in (other, allowed / "link", allowed / "run1" / ".." / ".." / "secret", Path("/etc")):
        r = app.post("/update_weights_from_disk", json={"model_path": str(path)})
        message = r.json()["message"]
        assert r.status_code == 400 and "--allowed-weight-dirs" in message and str(path) in message, message
    assert engine.work == []
    assert app.post("/update_weights_from_disk", json={"model_path": str(allowed / "run1")}).status_code == 200
    assert engine.work == ["update_weights_from_disk"]
    anywhere, engine = _app()  # control: no allowed dirs (library use) reads anywhere
    assert anywhere.post("/update_weights_from_disk", json={"model_path": str(other)}).status_code == 200


# -- the CLI --------------------------------------------------------------------------------------


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    src = str(Path(__file__).parents[1] / "src")
    full = dict(os.environ, PYTHONPATH=src) | (env or {})
    cmd = [sys.executable, "-m", "samebits.cli", "serve", "--port", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full)


def test_a_non_loopback_host_without_an_admin_key_is_refused_in_one_line(tiny):
    r = _serve("--model", str(tiny), "--host", "0.0.0.0")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--admin-api-key" in lines[0] and "--allow-unauthenticated" in lines[0], r.stderr


@pytest.fixture(scope="module")
def keyed(tiny, tmp_path_factory):
    """A server with the API key from $VLLM_API_KEY and an admin key, on 127.0.0.1."""
    path = tmp_path_factory.mktemp("keyed") / "tiny"
    shutil.copytree(tiny, path)
    os.environ["VLLM_API_KEY"] = API
    try:
        srv = Server(path, "--max-model-len", "64", "--admin-api-key", ADMIN, "--max-n", "2")
    finally:
        del os.environ["VLLM_API_KEY"]
    srv.path = path
    yield srv
    srv.stop()


def test_the_openai_client_and_the_weight_client_send_their_keys(keyed):
    kw = dict(base_url=f"{keyed.url}/v1", timeout=60, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", **kw).completions.create(model=keyed.model, prompt=[1, 2], max_tokens=2)
    done = openai.OpenAI(api_key=API, **kw).completions.create(model=keyed.model, prompt=[1, 2], max_tokens=2)
    assert len(done.choices[0].text) >= 0 and done.usage.completion_tokens == 2
    with pytest.raises(WeightSyncError, match="401"):
        Client(keyed.url, timeout=60, api_key=API).weight_specs()
    admin = Client(keyed.url, timeout=60, api_key=ADMIN)
    assert admin.weight_specs() and admin.get_weight_version() == "default"
    assert admin.generate([1, 2], {"max_new_tokens": 2})["output_ids"]
    r = httpx.post(f"{keyed.url}/v1/completions", json={"prompt": [1], "max_tokens": 2, "n": 3},
                   headers={"Authorization": f"Bearer {API}"})  # fmt: skip
    assert r.status_code == 400 and "--max-n" in r.text
    assert httpx.get(f"{keyed.url}/health").status_code == 200


def test_the_default_weight_dir_is_the_models(keyed, tiny, tmp_path):
    admin = Client(keyed.url, timeout=60, api_key=ADMIN)
    link = tmp_path / "elsewhere"
    link.symlink_to(tiny)  # the same files, reached from outside the allowed dir
    with pytest.raises(WeightSyncError, match="--allowed-weight-dirs"):
        admin.update_weights_from_disk(str(link))
    with pytest.raises(WeightSyncError, match="--allowed-weight-dirs"):
        admin.update_weights_from_disk(str(tiny))  # the test's own copy: not the server's dir
    admin.update_weights_from_disk(str(keyed.path))  # its own dir: read


def test_allow_unauthenticated_overrides_the_refusal_and_is_logged(tiny, capsys, monkeypatch):
    """The options' own check (no socket is bound here: tests bind 127.0.0.1 only)."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("SAMEBITS_ADMIN_API_KEY", raising=False)
    from samebits.cli import build_parser
    from samebits.serve.cli import security

    def parse(*extra):
        return build_parser().parse_args(["serve", "--model", str(tiny), *extra])

    with pytest.raises(ValueError, match="--admin-api-key"):
        security(parse("--host", "10.1.2.3"), tiny)
    keys, _, dirs = security(parse("--host", "10.1.2.3", "--allow-unauthenticated"), tiny)
    assert not keys.admin_guarded and dirs == [tiny]
    assert "WARNING: --allow-unauthenticated" in capsys.readouterr().err
    for guarded in (("--admin-api-key", ADMIN), ("--api-key", API)):  # either key guards admin
        assert security(parse("--host", "0.0.0.0", *guarded), tiny)[0].admin_guarded
    assert not security(parse("--host", "::1"), tiny)[0].admin_guarded  # loopback: open is fine
    assert "WARNING" not in capsys.readouterr().err
