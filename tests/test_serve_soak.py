"""A bounded soak of `samebits serve`: 500 requests from 32 clients, mixed endpoints, streams,
aborts and bad requests. No request lost, no 5xx, no KV block leaked, memory flat."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_server import Server

from samebits.model.tiny_tokenizer import add_tiny_tokenizer

REQUESTS, CLIENTS = 500, 32
RSS_GROWTH_LIMIT_KIB = 64 * 1024  # the second half of the soak may not grow the server by more


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("soak") / "tiny-tok"
    shutil.copytree(tiny, path)
    srv = Server(add_tiny_tokenizer(path), "--max-num-seqs", "16", "--max-model-len", "128")
    yield srv
    srv.stop()


def _request(url: str, i: int) -> tuple[int, int, str | None]:
    """One request of kind i % 6 -> (request number, HTTP status, finish reason or None)."""
    n = 2 + i % 4
    kind = i % 6
    with httpx.Client(timeout=120) as h:
        if kind == 0:
            r = h.post(
                f"{url}/v1/completions", json={"prompt": [5, i % 300], "max_tokens": n, "ignore_eos": True}
            )
            return i, r.status_code, r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else None
        if kind == 1:
            msgs = [{"role": "user", "content": f"soak {i}"}]
            body = {"messages": msgs, "max_tokens": n, "ignore_eos": True, "stream": True}
            with h.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                events = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
            reason = json.loads(events[-2])["choices"][0]["finish_reason"] if r.status_code == 200 else None
            return i, r.status_code, reason
        if kind in (2, 3):
            sp = {"max_new_tokens": n, "ignore_eos": True, "n": 1 + kind - 2}
            r = h.post(f"{url}/generate", json={"input_ids": [7, i % 300], "sampling_params": sp})
            out = r.json()
            out = out[-1] if isinstance(out, list) else out
            return i, r.status_code, out["meta_info"]["finish_reason"]["type"] if r.status_code == 200 else None
        if kind == 4:  # a long stream the client abandons after its first event
            body = {"input_ids": [3, i % 300], "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
            with h.stream("POST", f"{url}/generate", json=body | {"stream": True}) as r:
                next(x for x in r.iter_lines() if x.startswith("data: "))
            return i, r.status_code, "abandoned"
        r = h.post(f"{url}/v1/completions", json={"prompt": [5, 10**6], "max_tokens": n})  # a bad one
        return i, r.status_code, None


def test_soak_500_requests_32_clients(server):
    url = server.url
    with ThreadPoolExecutor(CLIENTS) as pool:
        first = list(pool.map(lambda i: _request(url, i), range(REQUESTS // 2)))
        rss_mid = server.rss_kib()
        second = list(pool.map(lambda i: _request(url, i), range(REQUESTS // 2, REQUESTS)))
    results = first + second
    assert sorted(i for i, _, _ in results) == list(range(REQUESTS))  # none lost
    for i, status, reason in results:
        if i % 6 == 5:
            assert status == 400
        else:
            assert status == 200 and reason in ("length", "abandoned"), (i, status, reason)
    assert httpx.get(f"{url}/health").status_code == 200
    # abandoned streams are aborted when the server next writes to them: let them drain
    with httpx.Client(timeout=120) as h:
        h.post(f"{url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 70}})
    assert server.metric("samebits_requests_in_flight") == 0
    assert server.metric("samebits_kv_blocks_used") == 0
    assert server.metric("samebits_num_requests_running") == 0
    assert server.rss_kib() - rss_mid < RSS_GROWTH_LIMIT_KIB
