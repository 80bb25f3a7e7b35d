"""`--logprob-formula` on the command line: `samebits serve` and `samebits rl` take a trainer line by
name and it reaches the engine (docs/logprobs.md).

Claims: the flags offer exactly `LOGPROB_FORMULAS`, default log_softmax; a server started with
`--logprob-formula verl` reports the verl line of the HF trainer model's logits bit for bit; an RL
step with `logprob_formula="verl"` reports the verl line and its trainer recomputes the same, 0
mismatches. Controls: the default line on the same tokens differs (verl's bf16 branch), and an RL
trainer left on the default line while the engine reports verl mismatches.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil

import httpx
import pytest
import torch
from serve_server import Server

from samebits import batch_invariant, rl, trainer
from samebits.cli import build_parser
from samebits.model.tiny_tokenizer import add_tiny_tokenizer
from samebits.numerics import logprob_formulas as lf
from samebits.requests.sampling_params import LOGPROB_FORMULAS
from samebits.rl.cli import config_from_args
from samebits.rl.loop import RLLoop

T = 1.3  # not a bf16 value: verl's divisor is rounded, its log-softmax is bf16


def _choices(command: str) -> tuple:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if a.dest == "logprob_formula")
    return tuple(action.choices), action.default


@pytest.mark.parametrize("command", ["serve", "rl"])
def test_flag_offers_every_formula_and_defaults_to_log_softmax(command, capsys):
    assert _choices(command) == (LOGPROB_FORMULAS, "log_softmax")
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--logprob-formula", "openrlhf"])
    assert "invalid choice: 'openrlhf'" in capsys.readouterr().err


def test_rl_flag_reaches_the_config():
    args = build_parser().parse_args(["rl", "--logprob-formula", "trl"])
    assert config_from_args(args).logprob_formula == "trl"
    assert config_from_args(build_parser().parse_args(["rl"])).logprob_formula == "log_softmax"


def _hf_rows(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(prompt + tokens)
    with batch_invariant(), torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
    return logits[len(prompt) - 1 : -1], ids[len(prompt) :]


def _line(name: str, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    with batch_invariant():
        return lf.token_logprobs(logits, ids, [T] * len(ids), [name] * len(ids))


def test_serve_flag_reaches_the_engine(tiny, tmp_path):
    ckpt = add_tiny_tokenizer(shutil.copytree(tiny, tmp_path / "tiny-tok"))
    srv = Server(ckpt, "--max-num-seqs", "2", "--max-model-len", "64", "--logprob-formula", "verl")
    try:
        # a logits mode names no formula, so the server's verl applies: refused as a 400 naming
        # both; the requests after it are served
        sp = {"temperature": T, "max_new_tokens": 8, "logprobs_mode": "raw_logits"}
        bad = httpx.post(f"{srv.url}/generate", json={"input_ids": [5, 9], "sampling_params": sp}, timeout=120)
        got = []
        for i, prompt in enumerate([[5, 9, 11, 4], [8, 6, 7]]):
            sp = {"temperature": T, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": i}
            body = {"input_ids": prompt, "sampling_params": sp, "return_logprob": True}
            answer = httpx.post(f"{srv.url}/generate", json=body, timeout=120).json()
            lps = torch.tensor([x[0] for x in answer["meta_info"]["output_token_logprobs"]])
            got.append((prompt, answer["output_ids"], lps))
    finally:
        srv.stop()
    assert bad.status_code == 400 and "logprobs_mode" in bad.text and "'verl'" in bad.text, bad.text
    model = trainer.load_hf_model(ckpt, dtype=torch.bfloat16)
    for prompt, tokens, lps in got:
        logits, ids = _hf_rows(model, prompt, tokens)
        assert torch.equal(lps, _line("verl", logits, ids)), (prompt, tokens)
        # control: the server's default line on the same tokens is other bits
        assert not torch.equal(lps, _line("log_softmax", logits, ids)), (prompt, tokens)


def test_serve_logprobs_mode_flag_reaches_the_engine(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--logprobs-mode", "logits"])
    assert "invalid choice: 'logits'" in capsys.readouterr().err
    ckpt = add_tiny_tokenizer(shutil.copytree(tiny, tmp_path / "tiny-tok"))
    srv = Server(ckpt, "--max-num-seqs", "2", "--max-model-len", "64", "--logprobs-mode", "processed_logprobs")
    try:
        prompt = [5, 9, 11, 4]
        sp = {"temperature": T, "top_p": 0.8, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3}
        body = {"input_ids": prompt, "sampling_params": sp, "return_logprob": True}
        answer = httpx.post(f"{srv.url}/generate", json=body, timeout=120).json()
        sp_openai = {"temperature": T, "top_p": 0.8, "max_tokens": 8, "ignore_eos": True, "seed": 3}
        body = {"prompt": prompt, "logprobs": 1, "return_token_ids": True} | sp_openai
        choice = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    finally:
        srv.stop()
    lps = torch.tensor([x[0] for x in answer["meta_info"]["output_token_logprobs"]])
    logits, ids = _hf_rows(trainer.load_hf_model(ckpt, dtype=torch.bfloat16), prompt, answer["output_ids"])
    with batch_invariant():
        assert torch.equal(lps, trainer.processed_logprobs(logits, ids, T, top_p=0.8))
        kept = trainer.kept_tokens(logits, T, top_p=0.8).sum(-1).tolist()
        wider = trainer.kept_tokens(logits, T, top_p=0.9).sum(-1).tolist()
    assert not torch.equal(lps, _line("log_softmax", logits, ids))  # control: the raw line
    # each token's support, as served: the trainer's kept set at top_p 0.8 (control: 0.9 keeps more)
    assert answer["meta_info"]["output_token_num_kept"] == kept and kept != wider
    assert all(0 < k < logits.shape[-1] for k in kept)
    assert choice["num_kept"] == kept and choice["token_ids"] == answer["output_ids"]


def test_a_request_picks_its_own_logprobs_mode(tiny, tmp_path):
    # a server on the default raw_logprobs: a /generate body's sampling_params.logprobs_mode and a
    # /v1/completions body's logprobs_mode pick that request's mode; an unknown mode is a 400
    # naming the field, and so is a logits mode with a formula; the server serves the requests
    # after them. Control: the same /generate body without the field reports the raw line.
    ckpt = add_tiny_tokenizer(shutil.copytree(tiny, tmp_path / "tiny-tok"))
    srv = Server(ckpt, "--max-num-seqs", "2", "--max-model-len", "64")
    prompt = [5, 9, 11, 4]
    sp = {"temperature": T, "top_p": 0.8, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3}
    completion = {"prompt": prompt, "logprobs": 0, "return_token_ids": True, "logprobs_mode": "raw_logits",
                  "temperature": T, "top_p": 0.8, "max_tokens": 8, "ignore_eos": True, "seed": 3}  # fmt: skip
    try:
        unknown = completion | {"logprobs_mode": "logits"}
        bad = httpx.post(f"{srv.url}/v1/completions", json=unknown, timeout=120)
        mixed = sp | {"logprobs_mode": "raw_logits", "logprob_formula": "trl"}
        mixed_body = {"input_ids": prompt, "sampling_params": mixed}
        bad_mix = httpx.post(f"{srv.url}/generate", json=mixed_body, timeout=120)
        answers = {}
        for mode in ("processed_logprobs", None):
            params = sp | ({"logprobs_mode": mode} if mode else {})
            body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
            answers[mode] = httpx.post(f"{srv.url}/generate", json=body, timeout=120).json()
        choice = httpx.post(f"{srv.url}/v1/completions", json=completion, timeout=120).json()["choices"][0]
    finally:
        srv.stop()
    assert bad.status_code == 400 and "logprobs_mode" in bad.text, bad.text
    assert bad_mix.status_code == 400 and "logprobs_mode" in bad_mix.text, bad_mix.text
    tokens = answers[None]["output_ids"]
    assert answers["processed_logprobs"]["output_ids"] == tokens == choice["token_ids"]
    logits, ids = _hf_rows(trainer.load_hf_model(ckpt, dtype=torch.bfloat16), prompt, tokens)
    processed, raw = (
        torch.tensor([x[0] for x in answers[m]["meta_info"]["output_token_logprobs"]])
        for m in ("processed_logprobs", None)
    )
    with batch_invariant():
        assert torch.equal(processed, trainer.processed_logprobs(logits, ids, T, top_p=0.8))
    assert torch.equal(raw, _line("log_softmax", logits, ids)) and not torch.equal(raw, processed)
    served_logits = torch.tensor(choice["logprobs"]["token_logprobs"])
    assert torch.equal(served_logits, logits.float().gather(1, ids[:, None])[:, 0])
    assert "output_token_num_kept" in answers["processed_logprobs"]["meta_info"]
    assert "output_token_num_kept" not in answers[None]["meta_info"]


def _rl_step(tiny, engine: str, trainer_line: str) -> dict:
    cfg = rl.RLConfig(
        model=str(tiny), steps=1, num_prompts=2, n=2, max_tokens=8, temperature=T, logprob_formula=engine
    )
    loop = RLLoop(cfg)
    assert loop.llm.engine.logprob_formula == engine
    # the control: the trainer's recompute and update on another line than the engine's
    loop.config = dataclasses.replace(cfg, logprob_formula=trainer_line)
    return loop.step()


def test_rl_formula_reaches_engine_and_trainer_with_no_mismatch(tiny):
    row = _rl_step(tiny, "verl", "verl")
    assert row["rollout_logprobs_tokens"] > 0
    assert row["rollout_logprobs_mismatch_count"] == 0 and row["old_logprobs_mismatch_count"] == 0, row


def test_control_rl_trainer_on_the_default_line_mismatches_the_engines_verl(tiny):
    row = _rl_step(tiny, "verl", "log_softmax")
    assert row["rollout_logprobs_mismatch_count"] > 0, row
