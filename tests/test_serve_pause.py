"""SGLang's /pause_generation and /continue_generation as AReaL drives them around a weight
update, against a `samebits serve` subprocess on 127.0.0.1 (CPU, tiny model).

AReaL 1.0.4 does not install beside samebits (it pins transformers<=5.3 and torch<2.11), so its
client is written here as its code runs: `areal/engine/sglang_remote.py` builds each /generate
body (`build_generation_request`) and the pause and continue bodies (`{}`);
`areal/infra/remote_inf_engine.py` `agenerate` resends an aborted request with its tokens
appended to the prompt and `max_new_tokens` reduced by them, and tags each token with the
weight version it was sampled on. The claim: every segment's log-probs are `torch.equal` to the
trainer's replay on the weights of the version the answer names. Control: the first segment
replayed on the new weights differs.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from serve_server import Server

from samebits import batch_invariant, trainer
from samebits.client import Client

CLIENTS, MAX_NEW = 6, 160
TEMPS = (1.0, 0.7)
WAIT = 120  # seconds: the bound on every HTTP wait


@pytest.fixture(scope="module")
def server(tiny):
    srv = Server(tiny, "--max-num-seqs", "8", "--max-model-len", "256")
    yield srv
    srv.stop()


def _areal_body(input_ids: list[int], max_new_tokens: int, temperature: float) -> dict:
    """AReaL 1.0.4's SGLangBackend.build_generation_request, with its default GenerationHyperparameters."""
    sampling = {
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "stop_token_ids": [],
        "ignore_eos": True,
        "skip_special_tokens": True,
        "frequency_penalty": 0.0,
    }
    return {"input_ids": list(input_ids), "image_data": None, "sampling_params": sampling,
            "return_logprob": True, "stream": False}  # fmt: skip


class _Rollout(threading.Thread):
    """One AReaL agenerate loop: /generate until "length", resending after each "abort"."""

    def __init__(self, url: str, i: int):
        super().__init__(daemon=True)
        self.url, self.prompt, self.temperature = url, [3 + i, 9, 4 + i % 3, 17 + i], TEMPS[i % 2]
        self.segments: list[tuple[str, list[int], list[float]]] = []  # (weight_version, tokens, log-probs)
        self.answered_at: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            ids, left, reason = list(self.prompt), MAX_NEW, None
            with httpx.Client(timeout=WAIT) as h:
                while reason != "length" and left > 0:
                    r = h.post(f"{self.url}/generate", json=_areal_body(ids, left, self.temperature))
                    assert r.status_code == 200, r.text
                    meta = r.json()["meta_info"]
                    reason = meta["finish_reason"]["type"]
                    tokens = [x[1] for x in meta["output_token_logprobs"]]
                    lps = [x[0] for x in meta["output_token_logprobs"]]
                    self.segments.append((meta["weight_version"], tokens, lps))
                    self.answered_at.append(time.monotonic())
                    ids, left = ids + tokens, left - len(tokens)
        except BaseException as e:  # noqa: BLE001 - the test re-raises it
            self.error = e


def _first_tokens(url: str) -> None:
    """Return once a streamed request has seen 3 tokens: generation is under way."""
    body = _areal_body([5, 6, 7], MAX_NEW, 1.0) | {"stream": True}
    with httpx.Client(timeout=WAIT) as h, h.stream("POST", f"{url}/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and len(json.loads(line[6:])["output_ids"]) >= 3:
                return


def _in_flight(h: httpx.Client, url: str) -> float:
    lines = h.get(f"{url}/metrics").text.splitlines()
    gauge = [x for x in lines if x.startswith("samebits_requests_in_flight ")]
    assert len(gauge) == 1, gauge
    return float(gauge[0].split()[-1])


def _moved(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: (t.float() + 0.02 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in base.items()}


def _replay(model, weights, prompt: list[int], before: list[int], tokens: list[int], t: float) -> torch.Tensor:
    """The trainer's log-probs of `tokens` after prompt + `before`, on `weights`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    with batch_invariant():
        seq = prompt + before + tokens
        return trainer.token_logprobs(model, [seq], [len(prompt) + len(before)], temperature=t)[0]


def test_areal_pause_update_continue_each_segment_equals_its_versions_replay(server, tiny):
    model = trainer.load_hf_model(tiny, dtype=torch.bfloat16)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = _moved(base)
    rollouts = [_Rollout(server.url, i) for i in range(CLIENTS)]
    for r in rollouts:
        r.start()
    watcher = threading.Thread(target=_first_tokens, args=(server.url,), daemon=True)
    watcher.start()
    watcher.join(WAIT)
    with httpx.Client(timeout=WAIT) as h:
        assert h.post(f"{server.url}/pause_generation", json={}).json()["status"] == "ok"
        assert _in_flight(h, server.url) == 0  # every request in flight ended before the pause returned
        time.sleep(1.0)  # the resent requests reach the server and are held
        assert all(len(r.segments) == 1 for r in rollouts), [len(r.segments) for r in rollouts]
        assert all(r.segments[0][0] == "default" for r in rollouts)
        Client(server.url, timeout=WAIT).update_weights_from_tensor(new.items(), weight_version="v1")
        updated_at = time.monotonic()
        assert h.post(f"{server.url}/continue_generation", json={}).json()["status"] == "ok"
    for r in rollouts:
        r.join(WAIT)
        assert not r.is_alive() and r.error is None, r.error
    aborted = [r for r in rollouts if len(r.segments) == 2]
    assert aborted, "no request was in flight at the pause"
    for r in rollouts:
        assert sum(len(s[1]) for s in r.segments) == MAX_NEW
        if len(r.segments) == 2:
            assert r.answered_at[1] > updated_at and r.segments[1][0] == "v1"  # held, then on v1

    for r in rollouts:
        before: list[int] = []
        for version, tokens, lps in r.segments:
            weights = base if version == "default" else new
            want = _replay(model, weights, r.prompt, before, tokens, r.temperature)
            assert torch.equal(torch.tensor(lps, dtype=torch.float32), want), (r.prompt, version)
            before += tokens
    # control: the segments sampled before the pause, replayed on the new weights, differ
    for r in aborted:
        _, tokens, lps = r.segments[0]
        wrong = _replay(model, new, r.prompt, [], tokens, r.temperature)
        assert not torch.equal(torch.tensor(lps, dtype=torch.float32), wrong), r.prompt


def test_pause_modes_that_keep_requests_across_an_update_are_refused_and_the_server_serves_on(server):
    with httpx.Client(timeout=WAIT) as h:
        for mode in ("retract", "in_place"):
            r = h.post(f"{server.url}/pause_generation", json={"mode": mode})
            assert r.status_code == 400 and r.json()["error"]["param"] == "mode", r.text
            assert "two weight versions" in r.json()["error"]["message"]
        r = h.post(f"{server.url}/pause_generation", json={"mode": "abort", "until": 3})
        assert r.status_code == 400, r.text
        r = h.post(f"{server.url}/generate", json=_areal_body([3, 4], 4, 1.0))
        assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length"


def test_a_held_request_whose_client_goes_leaves_nothing_behind(server):
    with httpx.Client(timeout=WAIT) as h:
        assert h.post(f"{server.url}/pause_generation").status_code == 200  # no body: SGLang's default mode
        with pytest.raises(httpx.ReadTimeout):
            h.post(f"{server.url}/generate", json=_areal_body([3, 4], 8, 1.0), timeout=1.0)
        assert h.post(f"{server.url}/continue_generation").status_code == 200
        r = h.post(f"{server.url}/generate", json=_areal_body([3, 4], 8, 1.0))
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 8
        assert _in_flight(h, server.url) == 0
