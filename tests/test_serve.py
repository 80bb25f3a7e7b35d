"""`samebits serve` over loopback: the official openai client, 16 mixed concurrent clients whose
log-probs equal the trainer's packed recompute bit for bit, replay alone, streamed = whole,
abort, 400s. The server is a subprocess on 127.0.0.1, stopped by its PID."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from serve_server import Server

from samebits import batch_invariant, trainer

READY_TIMEOUT = 180


@pytest.fixture(scope="module")
def server(ckpt):
    srv = Server(ckpt, "--max-num-seqs", "8", "--max-model-len", "256")
    yield srv
    srv.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)


# -- one request of each kind, reduced to (prompt ids, token ids, log-probs, text) ----------------


def _completion(server, i: int, stream: bool):
    extra = {"return_token_ids": True, "ignore_eos": True}
    kw = dict(model=server.model, max_tokens=6 + i % 5, seed=i, logprobs=1, extra_body=extra)
    prompt = f"prompt {i}" if i % 2 else [5 + i, 6, 7, 8 + i]
    c = _client(server)
    if not stream:
        ch = c.completions.create(prompt=prompt, **kw).choices[0]
        return ch.prompt_token_ids, ch.token_ids, ch.logprobs.token_logprobs, ch.text
    prompt_ids, ids, lps, text = None, [], [], ""
    for chunk in c.completions.create(prompt=prompt, stream=True, **kw):
        ch = chunk.choices[0]
        prompt_ids = getattr(ch, "prompt_token_ids", None) or prompt_ids
        ids += ch.token_ids
        lps += ch.logprobs.token_logprobs
        text += ch.text
    return prompt_ids, ids, lps, text


def _chat(server, i: int, stream: bool):
    extra = {"return_token_ids": True, "ignore_eos": True}
    msgs = [{"role": "user", "content": f"hello number {i}"}]
    kw = dict(model=server.model, messages=msgs, max_tokens=5 + i % 4, seed=i, logprobs=True, extra_body=extra)
    c = _client(server)
    if not stream:
        ch = c.chat.completions.create(**kw).choices[0]
        return ch.prompt_token_ids, ch.token_ids, [e.logprob for e in ch.logprobs.content], ch.message.content
    prompt_ids, ids, lps, text = None, [], [], ""
    for chunk in c.chat.completions.create(stream=True, **kw):
        ch = chunk.choices[0]
        prompt_ids = getattr(ch, "prompt_token_ids", None) or prompt_ids
        ids += ch.token_ids
        lps += [e.logprob for e in ch.logprobs.content]
        text += ch.delta.content or ""
    return prompt_ids, ids, lps, text


def _generate(server, i: int, stream: bool):
    sp = {"max_new_tokens": 4 + i % 6, "sampling_seed": i, "ignore_eos": True}
    body = {"input_ids": [9, 10 + i, 11], "sampling_params": sp, "return_logprob": True, "stream": stream}
    with httpx.Client(timeout=120) as h:
        if not stream:
            r = h.post(f"{server.url}/generate", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
        else:
            with h.stream("POST", f"{server.url}/generate", json=body) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            out = json.loads(events[-2])  # cumulative: the last event is the whole result
    lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    assert [x[1] for x in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    return body["input_ids"], out["output_ids"], lps, out["text"]


KINDS = [_completion, _chat, _generate]


def _run(server, i: int):
    return KINDS[i % 3](server, i, stream=bool(i // 3 % 2))


def _recompute(ckpt, results, device="cpu", **impl):
    model = trainer.load_hf_model(ckpt, device=device, dtype=torch.bfloat16, **impl)
    seqs = [p + t for p, t, _, _ in results]
    with batch_invariant():
        lps = trainer.token_logprobs(model, seqs, [len(p) for p, *_ in results], packed=True, temperature=1.0)
    return [lp.cpu() for lp in lps]


def test_16_concurrent_mixed_clients_equal_the_trainer_bitwise_and_replay_alone(server, ckpt):
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: _run(server, i), range(16)))
    for p, ids, lps, _ in results:
        assert p and len(ids) == len(lps) > 0
    want = _recompute(ckpt, results)
    for (_, _, lps, _), lp in zip(results, want, strict=True):
        assert torch.equal(torch.tensor(lps, dtype=torch.float32), lp)  # JSON number -> same float32
    for i, r in enumerate(results):  # alone, nothing else running
        assert _run(server, i) == r
    # negative control: the trainer with stock grouped_mm experts must differ
    neg = _recompute(ckpt, results, experts_implementation="grouped_mm")
    assert any(not torch.equal(torch.tensor(r[2]), lp) for r, lp in zip(results, neg, strict=True))
    assert server.metric("samebits_kv_blocks_used") == 0


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_streamed_chunks_join_to_the_whole_response(server, kind):
    whole, streamed = kind(server, 7, stream=False), kind(server, 7, stream=True)
    assert streamed == whole
    assert whole[3]  # text came back


def test_n_samples_and_top_logprobs_over_http(server):
    c = _client(server)
    kw = dict(model=server.model, prompt=[4, 5, 6], max_tokens=6, n=3, seed=11, logprobs=3)
    extra = {"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
    a = c.completions.create(extra_body=extra, **kw)
    b = c.completions.create(extra_body=extra, **kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert len({tuple(ch.token_ids) for ch in a.choices}) == 3
    assert [ch.token_ids for ch in a.choices] == [ch.token_ids for ch in b.choices]
    for ch in a.choices:
        rows = zip(ch.token_ids, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs, strict=True)
        for t, lp, top in rows:  # vLLM's: the sampled token first, then the top 3 of the same row
            assert list(top)[0] == f"token_id:{t}" and top[f"token_id:{t}"] == lp
            others = [v for k, v in top.items() if k != f"token_id:{t}"]  # the top 3, less the sampled
            assert len(others) in (2, 3) and (len(others) == 2 or lp <= min(others))
        assert ch.logprobs.tokens == [f"token_id:{t}" for t in ch.token_ids]


def test_prompt_logprobs_over_http_in_vllms_shape(server):
    """vLLM's JSON: each completions choice carries `prompt_logprobs`, null then {"<id>":
    {logprob, rank, decoded_token}} per position, the prompt token first, then the top k; a
    stream takes only k = 0 (vLLM's rule), in each choice's first piece; chat puts it on the
    response; out of range is a 400."""
    body = {"model": server.model, "prompt": [4, 5, 6, 7], "max_tokens": 3, "n": 2, "seed": 5}
    body |= {"prompt_logprobs": 2, "return_tokens_as_token_ids": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    got = [ch["prompt_logprobs"] for ch in r["choices"]]
    assert got[0] == got[1] and got[0][0] is None and len(got[0]) == 4
    for p, entry in enumerate(got[0][1:], start=1):
        token = entry[str(body["prompt"][p])]  # the prompt token first, then the top 2
        assert (
            list(entry)[0] == str(body["prompt"][p])
            and token["decoded_token"] == f"token_id:{body['prompt'][p]}"
        )
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked][:2] == [1, 2] and ranked[0]["logprob"] >= ranked[1]["logprob"]
        assert (token["rank"] <= 2) == (len(entry) == 2)  # one of the top 2, or listed beside them
    streamed = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=60)
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]  # vLLM's rule
    bare = body | {"stream": True, "prompt_logprobs": 0}  # 0 streams: the prompt tokens alone
    with httpx.stream("POST", f"{server.url}/v1/completions", json=bare, timeout=60) as s:
        pieces = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    firsts = [p["choices"][0] for p in pieces if "prompt_logprobs" in p["choices"][0]]
    assert sorted(ch["index"] for ch in firsts) == [0, 1]
    tokens = [str(t) for t in body["prompt"][1:]]
    for ch in firsts:  # the unstreamed answer's values of the prompt tokens
        assert ch["prompt_logprobs"][1:] == [{t: e[t]} for e, t in zip(got[0][1:], tokens, strict=True)]
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat | {"prompt_logprobs": 0}, timeout=60).json()
    assert r["prompt_logprobs"][0] is None and all(len(e) == 1 for e in r["prompt_logprobs"][1:])
    bad = httpx.post(f"{server.url}/v1/completions", json=body | {"prompt_logprobs": 21}, timeout=60)
    assert bad.status_code == 400 and "prompt_logprobs" in bad.json()["error"]["message"]
    after = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()  # still serving
    assert [ch["prompt_logprobs"] for ch in after["choices"]] == got


def test_stop_strings_over_http(server):
    c = _client(server)
    kw = dict(model=server.model, prompt="stop test", max_tokens=30, seed=3, extra_body={"ignore_eos": True})
    base = c.completions.create(**kw).choices[0].text
    stop = base[8:10]
    out = c.completions.create(stop=[stop], **kw).choices[0]
    assert out.finish_reason == "stop" and out.text == base[: base.find(stop)]


def test_abort_mid_stream_frees_its_blocks(server):
    body = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
        "stream": True,
    }
    body["rid"] = "abort-me"
    with httpx.Client(timeout=120) as h, h.stream("POST", f"{server.url}/generate", json=body) as r:
        lines = r.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        assert h.post(f"{server.url}/abort_request", json={"rid": "abort-me"}).status_code == 200
        events = [x[6:] for x in lines if x.startswith("data: ")]
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and len(last["output_ids"]) < 200
    assert server.metric("samebits_kv_blocks_used") == 0


def test_client_disconnect_aborts(server):
    body = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
        "stream": True,
    }
    aborted = server.metric("samebits_aborted_requests_total")
    with httpx.Client(timeout=120) as h, h.stream("POST", f"{server.url}/generate", json=body) as r:
        next(x for x in r.iter_lines() if x.startswith("data: "))
    deadline = time.monotonic() + 60  # the server notices the closed socket at its next write
    while server.metric("samebits_requests_in_flight") and time.monotonic() < deadline:
        pass
    assert server.metric("samebits_requests_in_flight") == 0
    assert server.metric("samebits_aborted_requests_total") == aborted + 1  # not a natural finish
    assert server.metric("samebits_kv_blocks_used") == 0


BAD = [
    ("/v1/completions", {"prompt": [1, 2], "top_p": 7}, 400, "top_p"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": "x"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 100000}, 400, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": [1, 2], "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": [1, 2], "model": "nope"}, 404, "model"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
        400,
        "temperature",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("/generate", {"text": "a", "input_ids": [1]}, 400, "text"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, 400, "top_k"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [-1]}}, 400, "stop_token_ids"),
    ("/abort_request", {}, 400, "rid"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_fields_get_openai_errors_naming_the_field(server, path, body, status, param):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.metric("samebits_kv_blocks_used") == 0


def test_models_and_health(server):
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [server.model]
    assert httpx.get(f"{server.url}/health").json() == {}


def test_logprobs_as_json_numbers_read_back_to_the_same_float32():
    """How the server writes a log-prob (json.dumps of the float) against a 6-digit writer."""
    from samebits.serve.streams import sse

    lps = torch.log_softmax(torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4, dim=0)
    event = sse({"token_logprobs": lps.tolist()})
    back = torch.tensor(json.loads(event[len("data: ") :])["token_logprobs"], dtype=torch.float32)
    assert torch.equal(back, lps)
    lossy = torch.tensor([float(f"{x:.6g}") for x in lps.tolist()], dtype=torch.float32)
    assert not torch.equal(lossy, lps)  # negative control: a shorter decimal loses bits
