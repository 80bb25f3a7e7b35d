"""A soak of `samebits serve` mixing weight updates with 512 sampled requests from 32 clients,
over loopback on the CPU: every request answered, each one's log-probs equal (torch.equal) to
the trainer's replay on the weights its `meta_info.weight_version` names, no KV block leaked,
memory flat.

A pusher thread hands the server a new version ("v1", "v2", ...: distinct perturbations of the
tiny model) by /update_weights_from_tensor every PUSH_EVERY answers, paced by answers rather than
by a clock. The engine's contract (`engine.engine_child`): an update waits until the requests
in flight have finished on the old weights, and requests that arrive meanwhile start after it,
so no request spans two versions, and the replay on one version's weights must reproduce all
of its tokens. Control: the replay on the next version's weights differs for every request.
"""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from serve_server import Server

from samebits import batch_invariant, trainer
from samebits.client import Client

REQUESTS, CLIENTS = 512, 32
PUSH_EVERY = 24  # answers between two weight updates: about 20 versions over the soak
ABORT_EVERY = 3  # every 3rd update aborts the requests in flight instead of waiting for them
TEMPS = (0.7, 1.0, 1.3)
RSS_GROWTH_LIMIT_KIB = 64 * 1024  # the second half of the soak may not grow the server by more
WAIT = 120  # seconds: the bound on every HTTP wait


@pytest.fixture(scope="module")
def server(tiny):
    srv = Server(tiny, "--max-num-seqs", "32", "--max-model-len", "128")
    yield srv
    srv.stop()


def _version(base: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """Version k of the weights: every tensor moved by its own seeded noise (k = 0: the base)."""
    if k == 0:
        return base
    g = torch.Generator().manual_seed(1000 + k)
    return {n: (t.float() + 0.01 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in base.items()}


def _body(i: int) -> dict:
    rng = random.Random(i)
    prompt = [rng.randrange(1, 384) for _ in range(rng.randrange(2, 9))]
    sp = {"max_new_tokens": 4 + i % 13, "temperature": TEMPS[i % 3], "ignore_eos": True, "sampling_seed": i}
    return {"input_ids": prompt, "sampling_params": sp, "return_logprob": True, "stream": i % 4 == 3}


def _request(url: str, i: int) -> dict:
    """One /generate (every 4th streamed) -> its HTTP status and, when 200, its final answer."""
    body = _body(i)
    with httpx.Client(timeout=WAIT) as h:
        if not body["stream"]:
            r = h.post(f"{url}/generate", json=body)
            answer = r.json() if r.status_code == 200 else None
            return {"i": i, "status": r.status_code, "answer": answer, "error": r.text[:300]}
        with h.stream("POST", f"{url}/generate", json=body) as r:
            events = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    answer = json.loads(events[-2]) if r.status_code == 200 and events[-1] == "[DONE]" else None
    return {"i": i, "status": r.status_code, "answer": answer, "error": events[-2:]}


class _Pusher(threading.Thread):
    """Pushes version k + 1 once PUSH_EVERY * k requests have been answered, until stopped."""

    def __init__(self, url: str, base: dict[str, torch.Tensor]):
        super().__init__(daemon=True)
        self.client, self.base = Client(url, timeout=WAIT), base
        self.answered, self.pushed = 0, 0
        self.cond, self.stopped, self.error = threading.Condition(), False, None

    def answer(self) -> None:
        with self.cond:
            self.answered += 1
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.join(WAIT)

    def run(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.stopped or self.answered >= PUSH_EVERY * (self.pushed + 1))
                    if self.stopped:
                        return
                k = self.pushed + 1
                named, abort = _version(self.base, k).items(), k % ABORT_EVERY == 0
                self.client.update_weights_from_tensor(named, abort_all_requests=abort, weight_version=f"v{k}")
                self.pushed = k
        except BaseException as e:  # noqa: BLE001 - the test re-raises it
            self.error = e


def _replay(model, weights: dict[str, torch.Tensor], answers: list[tuple[int, dict]]) -> list[torch.Tensor]:
    """The trainer's log-probs of each answer's tokens on `weights`, packed per temperature."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    out: dict[int, torch.Tensor] = {}
    for t in TEMPS:
        group = [(i, a) for i, a in answers if _body(i)["sampling_params"]["temperature"] == t]
        if not group:
            continue
        seqs = [_body(i)["input_ids"] + a["output_ids"] for i, a in group]
        lens = [len(_body(i)["input_ids"]) for i, _ in group]
        with batch_invariant():
            lps = trainer.token_logprobs(model, seqs, lens, packed=True, temperature=t)
        out |= {i: lp for (i, _), lp in zip(group, lps, strict=True)}
    return [out[i] for i, _ in answers]


def _logprobs(answer: dict) -> torch.Tensor:
    return torch.tensor([x[0] for x in answer["meta_info"]["output_token_logprobs"]], dtype=torch.float32)


def test_soak_512_requests_under_weight_updates_equal_their_versions_replay(server, tiny):
    model = trainer.load_hf_model(tiny, dtype=torch.bfloat16)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    pusher = _Pusher(server.url, base)
    pusher.start()

    def one(i: int) -> dict:
        try:
            return _request(server.url, i)
        except Exception as e:  # noqa: BLE001 - counted as lost below
            return {"i": i, "status": None, "answer": None, "error": repr(e)}
        finally:
            pusher.answer()

    with ThreadPoolExecutor(CLIENTS) as pool:
        first = list(pool.map(one, range(REQUESTS // 2)))
        rss_mid = server.rss_kib()
        second = list(pool.map(one, range(REQUESTS // 2, REQUESTS)))
    pusher.stop()
    assert pusher.error is None, pusher.error
    results = first + second
    answered = [r for r in results if r["status"] == 200 and r["answer"] is not None]
    refused = [r for r in results if r["status"] is not None and r["status"] != 200]
    lost = REQUESTS - len(answered) - len(refused)
    counts = f"tried {REQUESTS}, refused {len(refused)}, answered {len(answered)}, lost {lost}"
    assert sorted(r["i"] for r in results) == list(range(REQUESTS)), counts
    assert lost == 0 and not refused, (counts, [r for r in results if r not in answered][:3])

    by_version: dict[str, list[tuple[int, dict]]] = {}
    aborted = 0
    for r in answered:
        a, n = r["answer"], _body(r["i"])["sampling_params"]["max_new_tokens"]
        reason = a["meta_info"]["finish_reason"]["type"]
        assert reason in ("length", "abort"), reason
        assert len(a["output_ids"]) == n if reason == "length" else len(a["output_ids"]) < n
        aborted += reason == "abort"
        by_version.setdefault(a["meta_info"]["weight_version"], []).append((r["i"], a))
    pushed = {"default": 0} | {f"v{k}": k for k in range(1, pusher.pushed + 1)}
    assert set(by_version) <= set(pushed), sorted(by_version)
    assert len(by_version) >= 10, sorted(by_version)  # the soak did mix updates with requests
    assert aborted > 0  # and some updates did abort requests in flight
    print(f"\n{counts} ({aborted} aborted by an update); {pusher.pushed} updates, {len(by_version)} versions")

    for version, answers in by_version.items():
        k = pushed[version]
        want = _replay(model, _version(base, k), answers)
        for (i, a), lp in zip(answers, want, strict=True):
            assert torch.equal(_logprobs(a), lp), (i, version)
        # control: the next version's weights give other log-probs for every request with a token
        answers = [(i, a) for i, a in answers if a["output_ids"]]
        wrong = _replay(model, _version(base, k + 1), answers)
        assert not any(torch.equal(_logprobs(a), lp) for (_, a), lp in zip(answers, wrong, strict=True))

    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.metric("samebits_requests_in_flight") == 0
    assert server.metric("samebits_kv_blocks_used") == 0
    assert server.metric("samebits_num_requests_running") == 0
    assert server.rss_kib() - rss_mid < RSS_GROWTH_LIMIT_KIB
