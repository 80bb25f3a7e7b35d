"""What the SGLang speakers (slime, AReaL) send to `samebits serve`, as their released code
sends it (docs/serve.md, "SGLang speakers"): /get_model_info, /get_server_info and
/health_generate in SGLang's shapes with the server's own values; /generate with slime's and
AReaL's payloads, whose log-probs equal the trainer's recompute bit for bit (control: the
recompute at another temperature differs); their teachers' scoring requests
(`logprob_start_len`, slime's `max_new_tokens: 0`), whose `input_token_logprobs` equal the
trainer's recompute of the sequence, and `input_top_logprobs` the default row's top k; the
SGLang fields samebits does not implement refused naming the field. The server is a
subprocess on 127.0.0.1, stopped by its PID."""

from __future__ import annotations

import os

import httpx
import pytest
import torch
from serve_server import Server

from samebits import batch_invariant, trainer

T = 0.8


@pytest.fixture(scope="module")
def server(ckpt):
    srv = Server(
        ckpt, "--max-num-seqs", "4", "--max-model-len", "128", "--block-size", "8", "--enable-memory-saver"
    )
    yield srv
    srv.stop()


def _get(server, path):
    r = httpx.get(f"{server.url}{path}", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_info_endpoints_carry_the_servers_own_values(server, ckpt):
    version = _get(server, "/get_weight_version")["weight_version"]
    info = _get(server, "/get_model_info")
    assert os.path.realpath(info["model_path"]) == os.path.realpath(ckpt)
    assert info["is_generation"] is True and info["weight_version"] == version
    args = _get(server, "/get_server_info")  # what slime's external-engine check compares
    assert args["context_length"] == 128 and args["max_running_requests"] == 4 and args["page_size"] == 8
    assert (args["tp_size"], args["dp_size"], args["pp_size"], args["nnodes"]) == (1, 1, 1, 1)
    assert args["disable_radix_cache"] is False and args["weight_version"] == version
    assert args["enable_memory_saver"] is True  # --enable-memory-saver (test_serve_trl's server: False)
    assert f"http://{args['host']}:{args['port']}" == server.url
    # SGLang 0.5's names, which slime reads first: /server_info (beside vLLM's keys) and /model_info
    assert _get(server, "/server_info").items() >= args.items()
    assert _get(server, "/model_info") == info
    assert _get(server, "/health_generate") == {}
    assert server.metric("samebits_kv_blocks_used") == 0


SLIME = {  # slime/rollout/sglang_rollout.py: generate()
    "input_ids": [5, 6, 7, 8],
    "sampling_params": {
        "temperature": T,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 6,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "sampling_seed": 3,
    },
    "return_logprob": True,
}
AREAL = {  # areal/engine/sglang_remote.py: agenerate()
    "input_ids": [9, 10, 11],
    "image_data": None,
    "sampling_params": {
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 5,
        "temperature": T,
        "stop_token_ids": [],
        "frequency_penalty": 0.0,
    },
    "return_logprob": True,
    "stream": False,
}


def test_slime_and_areal_generate_payloads_equal_the_trainer_bitwise(server, ckpt):
    outs = []
    for body in (SLIME, AREAL):
        r = httpx.post(f"{server.url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        ids = [x[1] for x in meta["output_token_logprobs"]]
        assert ids == r.json()["output_ids"] and meta["finish_reason"]["type"] in ("stop", "length")
        outs.append((body["input_ids"], ids, torch.tensor([x[0] for x in meta["output_token_logprobs"]])))
    model = trainer.load_hf_model(ckpt, device="cpu", dtype=torch.bfloat16)

    def recompute(t):
        with batch_invariant():
            return trainer.token_logprobs(
                model, [p + c for p, c, _ in outs], [len(p) for p, *_ in outs], temperature=t
            )

    for (_, _, got), want in zip(outs, recompute(T), strict=True):
        assert torch.equal(got.float(), want)
    assert any(not torch.equal(got.float(), w) for (_, _, got), w in zip(outs, recompute(1.0), strict=True))


SEQ = [5, 6, 7, 8, 20, 21, 22, 23, 24]  # a prompt + completion to score
SLIME_OPD = {  # slime/rollout/on_policy_distillation.py: reward_func, the teacher's request
    "input_ids": SEQ,
    "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
    "return_logprob": True,
    "logprob_start_len": 0,
}
AREAL_SCORE = {  # AReaL's score request for a teacher's log-probs (docs/serve.md)
    "input_ids": SEQ,
    "sampling_params": {"max_new_tokens": 1, "temperature": T},
    "return_logprob": True,
    "logprob_start_len": 0,
    "top_logprobs_num": 0,
}


def _scores(server, body):
    r = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_input_token_logprobs_score_the_sequence_as_the_trainer_recomputes_it(server, ckpt):
    """SGLang's prompt scores (`logprob_start_len`, read from `meta_info.input_token_logprobs`):
    slime's on-policy-distillation teacher request (`max_new_tokens: 0`, greedy: read at T = 1)
    and AReaL's score request (T sent) equal the trainer's recompute of the sequence."""
    model = trainer.load_hf_model(ckpt, device="cpu", dtype=torch.bfloat16)

    def recompute(t):
        with batch_invariant():
            return trainer.token_logprobs(model, [SEQ], [1], temperature=t)[0]

    opd, score = _scores(server, SLIME_OPD), _scores(server, AREAL_SCORE)
    assert opd["output_ids"] == [] and opd["text"] == "" and opd["meta_info"]["completion_tokens"] == 0
    assert opd["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(score["output_ids"]) == 1
    for got, t in ((opd, 1.0), (score, T)):
        entries = got["meta_info"]["input_token_logprobs"]
        assert entries[0] == [None, SEQ[0], None] and [e[1] for e in entries] == SEQ
        values = torch.tensor([e[0] for e in entries[1:]], dtype=torch.float32)
        assert torch.equal(values, recompute(t))
        assert not torch.equal(values, recompute(1.3))  # control: the temperature reaches the values
    assert "input_top_logprobs" not in score["meta_info"]


def test_input_top_logprobs_from_a_start_position(server, ckpt):
    past = httpx.post(f"{server.url}/generate", json=AREAL_SCORE | {"logprob_start_len": len(SEQ)}, timeout=60)
    assert past.status_code == 400 and past.json()["error"]["param"] == "logprob_start_len"
    body = AREAL_SCORE | {"logprob_start_len": 3, "top_logprobs_num": 2}
    meta = _scores(server, body)["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == SEQ[3:]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None  # as SGLang
    del meta["input_token_logprobs"][0], meta["input_top_logprobs"][0]
    model = trainer.load_hf_model(ckpt, device="cpu", dtype=torch.bfloat16)
    with batch_invariant(), torch.no_grad():
        logits = model(input_ids=torch.tensor(SEQ)[None], use_cache=False).logits[0]
        row = torch.log_softmax(logits.float() / T, dim=-1)[3:-1]  # the rows scoring tokens 4..
    top = torch.sort(row, dim=-1, descending=True, stable=True)
    assert [[e[1] for e in at] for at in meta["input_top_logprobs"]] == top.indices[:, :2].tolist()
    got = torch.tensor([[e[0] for e in at] for at in meta["input_top_logprobs"]], dtype=torch.float32)
    assert torch.equal(got, top.values[:, :2])


@pytest.mark.parametrize(
    "edit,field",
    [
        ({"sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"sampling_params": {"presence_penalty": 0.5}}, "presence_penalty"),
        ({"sampling_params": {"repetition_penalty": 1.1}}, "repetition_penalty"),
        ({"sampling_params": {"min_p": 0.05}}, "min_p"),
        ({"image_data": ["data:image/png;base64,AAAA"]}, "image_data"),
        ({"return_routed_experts": True}, "return_routed_experts"),
        ({"logprob_start_len": -2}, "logprob_start_len"),
    ],
)
def test_unimplemented_sglang_fields_are_refused_naming_the_field(server, edit, field):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}} | edit
    if "sampling_params" in edit:
        body["sampling_params"] = {"max_new_tokens": 2} | edit["sampling_params"]
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_areals_pipeline_stage_is_refused_naming_pp_rank(server):
    # AReaL 1.0.4 (`build_init_weights_group_request`) adds pp_rank for pipeline-parallel engines;
    # its master_port is a string. Stage 0 is the whole model here; another is refused before a
    # group is made. The same body without pp_rank would open a group (tests/test_weight_sync.py).
    body = {"master_address": "127.0.0.1", "master_port": "29555", "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "group_name": "update_weight_group_1", "pp_rank": 1}  # fmt: skip
    r = httpx.post(f"{server.url}/init_weights_update_group", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "pp_rank" and "one pipeline stage" in err["message"]
