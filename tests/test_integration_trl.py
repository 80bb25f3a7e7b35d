"""TRL's own GRPOTrainer drives samebits through `samebits.integrations.trl` (docs/integrations.md).

A real `trl.GRPOTrainer` loop on the tiny model: 4 optimizer steps, a generation batch every 2
(`steps_per_generation=2`), so TRL itself computes `old_per_token_logps` (its recompute of every
sampled token, through its fused LM head) and the rollout's weights are pushed at global steps 0
and 2. The engine is a `samebits serve` on 127.0.0.1 (samebits' own protocol: `/generate`, the
gloo weight-update group, `/weight_digests`; stopped by its PID), or an in-process `samebits.LLM`
(weights pushed with `LLM.update_weights`).
Prompts of different token lengths and completions that end early make TRL pad, so the packed
path of `exact_logprobs` runs.
"""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")  # TRL's trainers need it; trl.kernels alone does not

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import samebits  # noqa: E402
from samebits import trainer as sb  # noqa: E402
from samebits.client import Client, spawn_server, stop_server  # noqa: E402
from samebits.engine.digest import tensor_digest  # noqa: E402
from samebits.integrations import trl as sbtrl  # noqa: E402

PROMPTS = ["hello there", "the cat sat", "what is it", "a b c d e"]
# for the shared-weights arms: one 16-byte prefix, so every batch reuses K/V cached by the one before
SHARED_PREFIX = ["once upon a time" + p for p in PROMPTS]


class RecordingGRPOTrainer(GRPOTrainer):
    """GRPOTrainer as released; each generation batch's TRL-computed tensors are kept."""

    batches: list[dict]

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        keep = ("old_per_token_logps", "sampling_per_token_logps", "completion_mask", "prompt_mask")
        self.batches.append({k: out[k].detach().clone() for k in keep if k in out})
        return out


@contextlib.contextmanager
def _engine(ckpt, where: str, model=None):
    """-> (what rollout_func takes, digests(names) of the engine's tensors). "shared": an LLM
    on `model`'s own tensors (one copy of the model, what fits a 30B trainer and its engine on
    one 80 GB card; blocks of 4 tokens, so the prompts' K/V are cached across batches and the
    cache must be forgotten at each push)."""
    if where in ("shared", "shared-stale"):
        llm = samebits.LLM(ckpt, weights=model.named_parameters(remove_duplicate=False), max_num_seqs=8,
                           max_model_len=64, block_size=4)  # fmt: skip
        if where == "shared-stale":  # the control: a push that keeps the cached K/V
            llm.reset_prefix_cache = lambda: True
        yield llm, llm.weight_digests
        return
    if where == "llm":
        llm = samebits.LLM(ckpt, max_num_seqs=8, max_model_len=64)
        yield llm, llm.weight_digests
        return
    proc, url = spawn_server(ckpt, "--max-num-seqs", "8", "--max-model-len", "64", ready_timeout=300)
    try:
        yield url, Client(url).weight_digests
    finally:
        stop_server(proc)


def _run(ckpt, tmp_path, where, config=None, **rollout_kwargs):
    """4 steps of GRPOTrainer with samebits' rollout -> (trainer, rollout, digest checks per batch)."""
    model = sb.load_hf_model(ckpt)
    prompts = SHARED_PREFIX if where.startswith("shared") else PROMPTS
    with _engine(ckpt, where, model) as (target, engine_digests):
        rollout = sbtrl.rollout_func(target, seed=1, **rollout_kwargs)
        try:
            return _train(model, tmp_path, rollout, engine_digests, config or {}, prompts)
        finally:
            rollout.close()


def _train(model, tmp_path, rollout, engine_digests, config, prompts):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    # a third of the vocabulary ends a completion (TRL stops at its model's generation_config EOS
    # ids), so completions end early at different lengths and TRL pads them on the right too
    model.generation_config.eos_token_id = list(range(4, 384, 3))
    digests = []  # per generation batch: (engine's == trainer's, the trainer's digests)

    def reward(completion_ids, **kwargs):
        # TRL calls rewards after the rollout and before the update: the weights it sampled with
        mine = {n: tensor_digest(p.detach()) for n, p in trainer.model.named_parameters()}
        digests.append((engine_digests(list(mine)) == mine, mine))
        return [float(sum(t % 2 for t in ids)) for ids in completion_ids]

    args = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=2,
        steps_per_generation=2,
        gradient_accumulation_steps=1,
        max_completion_length=6,
        max_steps=4,
        learning_rate=1e-2,
        temperature=0.7,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    trainer = RecordingGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**(args | config)),
        train_dataset=Dataset.from_dict({"prompt": prompts * 2}),
        rollout_func=rollout,
    )
    trainer.batches = []
    sbtrl.exact_logprobs(trainer)
    trainer.train()
    return trainer, rollout, digests


def _logged(trainer, name):
    return [h[name] for h in trainer.state.log_history if name in h]


def _differ(a, b):
    return int((a.view(torch.int32) != b.view(torch.int32)).sum())


@pytest.mark.parametrize("where", ["server", "llm", "shared"])
def test_trls_recompute_equals_the_rollout_bit_for_bit_with_a_weight_sync(ckpt, tmp_path, where):
    trainer, rollout, digests = _run(ckpt, tmp_path, where)
    assert trainer.state.global_step == 4
    assert [s for s, _ in rollout.syncs] == [0, 2]  # pushed when global_step moved, not in between
    assert len(trainer.batches) == 2
    # TRL padded prompts (left) and completions (right): the packed path ran
    assert any(not b["prompt_mask"].all() for b in trainer.batches)
    assert any(not b["completion_mask"].all() for b in trainer.batches)
    for b in trainer.batches:
        assert "old_per_token_logps" in b  # TRL's own recompute (steps_per_generation=2)
        mask = b["completion_mask"].bool()
        old, sampled = b["old_per_token_logps"][mask], b["sampling_per_token_logps"][mask]
        assert old.numel() > 0 and _differ(old, sampled) == 0
    # the integration's TRL-named metrics say the same, at every generation batch
    assert _logged(trainer, "sampling/sampling_logp_difference/max") == [0.0, 0.0]
    assert _logged(trainer, "sampling/importance_sampling_ratio/min") == [1.0, 1.0]
    assert _logged(trainer, "samebits/logprob_mismatch_count") == [0.0, 0.0]
    # the engine's weights are the trainer's by digest at each rollout, and the sync moved them
    # (shared weights: the same memory, so the digests agree by construction; what can fail there
    # is that the engine still runs on the trainer's tensors after TRL's steps)
    assert [same for same, _ in digests] == [True, True]
    assert digests[0][1] != digests[1][1]
    if where == "shared":
        engine = rollout.engine.llm.weight_store.params
        assert all(engine[n].data_ptr() == p.data_ptr() for n, p in trainer.model.named_parameters())


def test_a_shared_tensor_the_trainer_replaced_is_refused_at_the_push(ckpt):
    """An engine on the trainer's tensors whose trainer then replaced one (a cast, a move, a new
    tensor): the push raises naming it, rather than sampling from weights the trainer no longer
    trains. Control: the same push with every tensor in place passes."""
    from samebits.integrations.backends import LocalEngine

    model = sb.load_hf_model(ckpt)
    llm = samebits.LLM(ckpt, weights=model.named_parameters(remove_duplicate=False), max_num_seqs=2,
                       max_model_len=32)  # fmt: skip
    engine = LocalEngine(llm)
    engine.push(model.named_parameters())
    name, p = next(iter(model.named_parameters()))
    p.data = p.data.clone()
    with pytest.raises(RuntimeError, match=f"{name} is no longer the tensor it was built on"):
        engine.push(model.named_parameters())


@pytest.mark.parametrize("where", ["server", "llm"])
def test_control_the_default_formula_mismatches_trls_recompute(ckpt, tmp_path, where):
    """The same loop with the engine's default line (`log_softmax`) instead of TRL's: the
    weights still match, the log-probs do not (the formula is the claim's reason)."""
    trainer, _, digests = _run(ckpt, tmp_path, where, logprob_formula="log_softmax")
    assert [same for same, _ in digests] == [True, True]
    total = 0
    for b in trainer.batches:
        mask = b["completion_mask"].bool()
        total += _differ(b["old_per_token_logps"][mask], b["sampling_per_token_logps"][mask])
    assert total > 0
    assert sum(_logged(trainer, "samebits/logprob_mismatch_count")) == total
    assert max(_logged(trainer, "sampling/sampling_logp_difference/max")) > 0


def test_control_shared_weights_without_forgetting_the_cache_mismatch(ckpt, tmp_path):
    """The shared-weights arm with its push's prefix-cache reset taken out: the second batch's
    prompts reuse K/V computed before the optimizer step, and TRL's recompute on the new weights
    differs (the reset is what makes shared weights exact)."""
    trainer, _, digests = _run(ckpt, tmp_path, "shared-stale")
    assert [same for same, _ in digests] == [True, True]
    first, second = (b["completion_mask"].bool() for b in trainer.batches)
    b0, b1 = trainer.batches
    assert _differ(b0["old_per_token_logps"][first], b0["sampling_per_token_logps"][first]) == 0
    assert _differ(b1["old_per_token_logps"][second], b1["sampling_per_token_logps"][second]) > 0


def test_on_policy_batches_are_scored_by_trls_own_method_too(ckpt, tmp_path):
    """One generation batch a step (TRL's default cadence): TRL computes no old log-probs, so
    the metrics come from the integration's recompute with TRL's method; a push every step."""
    trainer, rollout, digests = _run(ckpt, tmp_path, "llm", config=dict(steps_per_generation=1, max_steps=2))
    assert all("old_per_token_logps" not in b for b in trainer.batches)
    assert [s for s, _ in rollout.syncs] == [0, 1] and [same for same, _ in digests] == [True, True]
    assert _logged(trainer, "samebits/logprob_mismatch_count") == [0.0, 0.0]
    assert _logged(trainer, "sampling/sampling_logp_difference/max") == [0.0, 0.0]
    assert all(n > 0 for n in _logged(trainer, "samebits/logprob_tokens"))


def _trainer(ckpt, tmp_path, model=None, rollout=None, **over):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    fields = dict(output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=2, max_steps=1)
    fields |= dict(num_generations=2, max_completion_length=4, report_to="none", save_strategy="no")
    return GRPOTrainer(
        model=model if model is not None else sb.load_hf_model(ckpt),
        reward_funcs=lambda completion_ids, **kw: [0.0] * len(completion_ids),
        args=GRPOConfig(**(fields | over)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        rollout_func=rollout,
    )


def test_unsupported_setups_are_refused_with_what_to_do(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="load_hf_model"):
        sbtrl.exact_logprobs(_trainer(ckpt, tmp_path, model=stock))
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32"):
        sbtrl.exact_logprobs(_trainer(ckpt, tmp_path, cast_lm_head_to_fp32=True))
    with pytest.raises(ValueError, match="repetition_penalty"):
        sbtrl.exact_logprobs(_trainer(ckpt, tmp_path, repetition_penalty=1.1))
    with pytest.raises(ValueError, match="use_reentrant"):
        sbtrl.exact_logprobs(_trainer(ckpt, tmp_path, activation_checkpointing_kwargs={"use_reentrant": True}))
    with pytest.raises(TypeError, match="samebits serve URL"):
        sbtrl.rollout_func("127.0.0.1:8000")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        with pytest.raises(ValueError, match="cannot use the samebits server"):
            sbtrl.rollout_func(f"http://127.0.0.1:{s.getsockname()[1]}")
    # a rollout on a trainer whose recompute is not under batch_invariant() stops at its first call
    rollout = sbtrl.rollout_func(samebits.LLM(ckpt, max_num_seqs=4, max_model_len=32))
    with pytest.raises(ValueError, match="exact_logprobs"):
        _trainer(ckpt, tmp_path, rollout=rollout).train()


def test_the_generate_body_carries_the_formula_and_refuses_an_unknown_one():
    """What the server rollout relies on (and probes at construction): /generate's
    sampling_params.logprob_formula reaches SamplingParams, and an unknown name is refused."""
    from samebits.serve.protocol import GenerateRequest

    body = {"input_ids": [5, 6], "sampling_params": {"logprob_formula": "trl"}}
    assert GenerateRequest(**body).to_params().logprob_formula == "trl"
    assert GenerateRequest(input_ids=[5]).to_params().logprob_formula is None  # the engine's default
    with pytest.raises(ValueError, match="logprob_formula"):
        GenerateRequest(input_ids=[5], sampling_params={"logprob_formula": "nope"}).to_params()


def test_checkpointing_is_found_under_either_transformers_name():
    """TrainingArguments before transformers 5.2x has `gradient_checkpointing` only (the device
    image's 5.17 refused `exact_logprobs` with an AttributeError); newer ones name it
    `activation_checkpointing`. Either way a reentrant setting is refused and a non-reentrant one
    gets samebits' context; control: checkpointing off is left alone."""
    from types import SimpleNamespace

    old = SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs=None)
    sbtrl._checkpoint_in_context(old)
    assert old.gradient_checkpointing_kwargs["context_fn"] is sb.checkpoint_context
    reentrant = SimpleNamespace(
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}
    )
    with pytest.raises(ValueError, match="use_reentrant=True"):
        sbtrl._checkpoint_in_context(reentrant)
    new = SimpleNamespace(
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False},
        gradient_checkpointing=False,
        gradient_checkpointing_kwargs=None,
    )
    sbtrl._checkpoint_in_context(new)
    assert new.activation_checkpointing_kwargs["context_fn"] is sb.checkpoint_context
    off = SimpleNamespace(gradient_checkpointing=False, gradient_checkpointing_kwargs=None)
    sbtrl._checkpoint_in_context(off)
    assert off.gradient_checkpointing_kwargs is None
