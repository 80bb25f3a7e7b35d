"""What the SGLang speakers (slime, AReaL) send to `samebits serve`, as their released code
sends it (docs/serve.md, "SGLang speakers"): /get_model_info, /get_server_info and
/health_generate in SGLang's shapes with the server's own values; /generate with slime's and
AReaL's payloads, whose log-probs equal the trainer's recompute bit for bit (control: the
recompute at another temperature differs); the SGLang fields samebits does not implement
refused naming the field. The server is a subprocess on 127.0.0.1, stopped by its PID."""

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


@pytest.mark.parametrize(
    "edit,field",
    [
        ({"sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"sampling_params": {"presence_penalty": 0.5}}, "presence_penalty"),
        ({"sampling_params": {"repetition_penalty": 1.1}}, "repetition_penalty"),
        ({"sampling_params": {"min_p": 0.05}}, "min_p"),
        ({"image_data": ["data:image/png;base64,AAAA"]}, "image_data"),
        ({"return_routed_experts": True}, "return_routed_experts"),
        ({"logprob_start_len": 0}, "logprob_start_len"),  # AReaL's score request (input_token_logprobs)
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
