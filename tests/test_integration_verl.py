"""verl's own rollout code drives samebits through `samebits.integrations.verl` (docs/integrations.md).

verl 0.9.1's config (its `ppo_trainer.yaml`, composed by Hydra with `rollout.name=samebits`), its
`LLMServerManager` (which builds the "samebits" `RolloutReplica` from `RolloutReplicaRegistry`
and its load balancer), its `LLMServerClient` and its `AgentLoopManager` with one
`AgentLoopWorker` running `SingleTurnAgentLoop` (chat template, `TokenOutput`, padding into the
`DataProto` with `rollout_log_probs`), on a local Ray cluster bound to 127.0.0.1.

Two steps: generate, an SGD step on the trainer's HF model, the weight sync, generate again.
Each step: verl's own log-prob line on the trainer model's logits (its FSDP engine's
`_scale_logits_by_temperature`, `logits / T.clamp(min=1e-8).to(logits.dtype)`, then
`verl.utils.torch_functional.logprobs_from_logits`, whose v2 branch runs without flash-attn) at
the sampled tokens equals the rollout's `rollout_log_probs` bit for bit, and verl's own counters
(`verl.utils.debug.metrics.calculate_debug_metrics`: `training/rollout_probs_diff_{max,mean,std}`)
read 0. The engine's weights equal the trainer's by digest after the sync, and moved.

What does not run here: verl's trainer workers (`ActorRolloutRefWorker` and its FSDP engine).
With no accelerator `verl.utils.device.get_device_name()` answers "cuda" and the worker builds
its device mesh there. Their two calls into the rollout are made as they make them: the log-prob
line above, and, for the sync, `replica.sleep()`, then on the `ServerAdapter` that
`get_rollout_class("samebits", "async")` returns `resume(["weights"])`,
`update_weights(per_tensor_param, peft_config=None, base_sync_done=True, global_steps=...)`,
`resume(["kv_cache"])` (`ActorRolloutRefWorker.update_weights`, checkpoint engine "naive").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from hf_rows import hf_rows  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.experimental.agent_loop import AgentLoopManager  # noqa: E402
from verl.utils.debug.metrics import calculate_debug_metrics  # noqa: E402
from verl.utils.torch_functional import logprobs_from_logits  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import _scale_logits_by_temperature  # noqa: E402
from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402
from verl.workers.rollout.replica import RolloutMode  # noqa: E402

import samebits  # noqa: E402
from samebits import trainer as sb  # noqa: E402
from samebits.engine.digest import tensor_digest  # noqa: E402
from samebits.integrations import verl as sbverl  # noqa: E402

T = 0.7  # not a bf16 value: verl's divisor is rounded to bf16 first (docs/logprobs.md)
PROMPTS = ["hello there", "the cat sat", "what is it", "a b c d e"]
COUNTERS = (
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_std",
)


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    src = str(Path(samebits.__file__).parent.parent)  # Ray's workers import this samebits
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0"}},
    )
    yield
    ray.shutdown()


def _config(ckpt, *extra):
    """verl's own trainer config, the lines a samebits user changes, and a tiny run's sizes."""
    import verl

    overrides = [
        "actor_rollout_ref.rollout.name=samebits",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.model.external_lib=samebits.integrations.verl",
        f"actor_rollout_ref.model.path={ckpt}",
        f"actor_rollout_ref.rollout.temperature={T}",
        "actor_rollout_ref.rollout.prompt_length=32",
        "actor_rollout_ref.rollout.response_length=6",
        "actor_rollout_ref.rollout.max_model_len=64",
        "actor_rollout_ref.rollout.max_num_seqs=8",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        *extra,
    ]
    with initialize_config_dir(
        config_dir=str(Path(verl.__file__).parent / "trainer/config"), version_base=None
    ):
        return compose(config_name="ppo_trainer", overrides=overrides)


@contextlib.contextmanager
def _rollout(config):
    """verl's server manager (the samebits replica and its load balancer) and agent loop."""
    manager = LLMServerManager.create(config)
    loop = AgentLoopManager.create(config, llm_client=manager.get_client())
    try:
        yield manager, loop
    finally:  # named actors: the next run makes its own
        for actor in [*loop.agent_loop_workers, manager.global_load_balancer]:
            ray.kill(actor)
        for replica in manager.get_replicas():
            for server in replica.servers:
                ray.kill(server)


def _generate(loop, step: int) -> DataProto:
    raw = np.array([[{"role": "user", "content": p}] for p in PROMPTS], dtype=object)
    return loop.generate_sequences(
        DataProto.from_dict(non_tensors={"raw_prompt": raw}, meta_info={"global_steps": step})
    )


def _verl_old_log_probs(model, out: DataProto) -> torch.Tensor:
    """[B, R] verl's line on the trainer model at each row's sampled tokens (0 at padding)."""
    prompts, responses = out.batch["prompts"], out.batch["responses"]
    p, mask = prompts.size(1), out.batch["response_mask"].bool()
    old = torch.zeros(responses.shape, dtype=torch.float32)
    for i in range(len(prompts)):
        row = SimpleNamespace(
            prompt_token_ids=prompts[i][out.batch["attention_mask"][i, :p].bool()].tolist(),
            token_ids=responses[i][mask[i]].tolist(),
        )
        _, logits, ids = hf_rows(model, row)  # [n, V] bf16, under batch_invariant()
        temperature = torch.full((1, 1, 1), T)  # verl: the batch's (bsz,) temperature, unsqueezed twice
        with samebits.batch_invariant():  # the trainer's recompute runs under it, as TRL's does
            scaled = _scale_logits_by_temperature(logits[None], temperature, is_unit_temperature=False)
            old[i, mask[i]] = logprobs_from_logits(scaled, ids[None])[0].float()  # bf16 row, widened
    return old


def _counters(out: DataProto, old: torch.Tensor) -> dict:
    data = DataProto.from_dict(
        tensors={
            "rollout_log_probs": out.batch["rollout_log_probs"],
            "old_log_probs": old,
            "response_mask": out.batch["response_mask"],
            "responses": out.batch["responses"],
        }
    )
    return calculate_debug_metrics(data)


def _differ(a, b) -> int:
    return int((a.view(torch.int32) != b.view(torch.int32)).sum())


def _sgd_step(model, out: DataProto) -> None:
    """The trainer's update (any will do): one SGD step on the LM loss of the first sequence."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = out.batch["input_ids"][:1]
    with samebits.batch_invariant():
        model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


async def _sync(config, replica, model, step: int) -> None:
    """What verl's ActorRolloutRefWorker.update_weights does with the "naive" checkpoint engine."""
    rollout = config.actor_rollout_ref
    adapter = get_rollout_class(rollout.rollout.name, rollout.rollout.mode)(
        config=rollout.rollout, model_config=rollout.model, device_mesh=None
    )
    await replica.sleep()
    await adapter.resume(tags=["weights"])
    params = ((n, p.detach()) for n, p in model.named_parameters())
    await adapter.update_weights(params, peft_config=None, base_sync_done=True, global_steps=step)
    await adapter.resume(tags=["kv_cache"])


def _digests(server, model) -> tuple[dict, dict]:
    mine = {n: tensor_digest(p.detach()) for n, p in model.named_parameters()}
    return ray.get(server.weight_digests.remote(list(mine))), mine


def test_verls_recompute_equals_the_rollout_bit_for_bit_across_a_weight_sync(cluster, ckpt):
    config = _config(ckpt)
    model = sb.load_hf_model(ckpt)
    with _rollout(config) as (manager, loop):
        replica = manager.get_replicas()[0]
        server = replica.servers[0]
        engines, trainers = [], []
        for step in (1, 2):
            if step > 1:
                asyncio.run(_sync(config, replica, model, step))
            engine, mine = _digests(server, model)
            engines.append(engine)
            trainers.append(mine)
            out = _generate(loop, step)
            mask = out.batch["response_mask"].bool()
            old, sampled = _verl_old_log_probs(model, out), out.batch["rollout_log_probs"]
            assert mask.sum() > 0 and sampled.dtype == torch.float32
            assert torch.equal(old[mask], sampled[mask]), (
                f"step {step}: {_differ(old[mask], sampled[mask])} differ"
            )
            counters = _counters(out, old)
            assert counters["training/rollout_probs_diff_valid"] == 1
            assert [counters[k] for k in COUNTERS] == [0.0, 0.0, 0.0]
            _sgd_step(model, out)
        assert engines == trainers  # the engine held the trainer's weights at each step
        assert trainers[0] != trainers[1]  # and the sync moved them
        # verl's client answers with the step the weights were tagged with; text only
        client = manager.get_client()
        params = dict(temperature=T, top_p=1.0, top_k=-1, logprobs=True, max_tokens=3)
        answer = asyncio.run(client.generate("r0", prompt_ids=[5, 6, 7], sampling_params=dict(params)))
        assert answer.extra_fields["global_steps"] == 2 and len(answer.log_probs) == len(answer.token_ids) > 0
        with pytest.raises(Exception, match="text prompts only"):
            asyncio.run(
                client.generate("r1", prompt_ids=[5, 6], sampling_params=dict(params), image_data=[object()])
            )


def test_control_the_default_formula_mismatches_verls_recompute(cluster, ckpt):
    """The same rollout with the engine's default line (`log_softmax`, float32) instead of
    verl's (a bf16 log_softmax of the bf16-divided logits): verl's recompute and counters differ."""
    config = _config(ckpt, "+actor_rollout_ref.rollout.engine_kwargs.samebits.logprob_formula=log_softmax")
    model = sb.load_hf_model(ckpt)
    with _rollout(config) as (manager, loop):
        out = _generate(loop, 1)
        engine, mine = _digests(manager.get_replicas()[0].servers[0], model)
    assert engine == mine  # the same weights: the formula is the difference
    mask = out.batch["response_mask"].bool()
    old = _verl_old_log_probs(model, out)
    assert _differ(old[mask], out.batch["rollout_log_probs"][mask]) > 0
    assert _counters(out, old)["training/rollout_probs_diff_max"] > 0


def test_unsupported_configs_are_refused_with_what_to_change(ckpt):
    def replica(*extra):
        config = _config(ckpt, *extra)
        return sbverl.SamebitsReplica(0, config.actor_rollout_ref.rollout, config.actor_rollout_ref.model)

    with pytest.raises(ValueError, match="tensor_model_parallel_size=1"):
        replica("actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    with pytest.raises(ValueError, match="repetition_penalty"):
        replica("+actor_rollout_ref.rollout.repetition_penalty=1.1")
    with pytest.raises(ValueError, match="quantization"):
        replica("actor_rollout_ref.rollout.quantization=fp8")
    with pytest.raises(ValueError, match="lora.merge=True"):
        replica("actor_rollout_ref.model.lora_rank=8")
    config = _config(ckpt).actor_rollout_ref
    adapter = sbverl.ServerAdapter(config.rollout, config.model, device_mesh=None)
    with pytest.raises(NotImplementedError, match="named_tensors"):
        asyncio.run(adapter.update_weights(iter([]), wire_format="delta_flush"))
    with pytest.raises(NotImplementedError, match="LoRA"):
        asyncio.run(adapter.update_weights(iter([]), peft_config={"r": 8}))


def test_the_server_maps_verls_sampling_dict_as_vllms_server_does(ckpt):
    """`SamebitsServer` in this process (verl runs it as a Ray actor): the vLLM server's rules
    for max_tokens, refusals by name, log_probs only when asked, the hybrid sleep/wake cycle."""
    config = _config(ckpt).actor_rollout_ref
    server = sbverl.SamebitsServer(config.rollout, config.model, RolloutMode.HYBRID, replica_rank=0)
    try:
        verls = dict(temperature=T, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
        sp = server.sampling_params(5, dict(verls))
        assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (T, 1.0, -1, 6)  # response_length
        assert server.sampling_params(5, verls | {"max_tokens": 1000}).max_tokens == 64 - 5  # max_model_len
        assert server.sampling_params(5, verls | {"max_new_tokens": 2}).max_tokens == 2
        with pytest.raises(ValueError, match="no room"):
            server.sampling_params(64, dict(verls))
        with pytest.raises(ValueError, match="min_p"):
            server.sampling_params(5, verls | {"min_p": 0.1})
        with pytest.raises(ValueError, match="repetition_penalty"):
            server.sampling_params(5, verls | {"repetition_penalty": 1.1})
        out = asyncio.run(server.generate([5, 6, 7], verls | {"logprobs": False, "max_tokens": 2}, "a"))
        assert len(out.token_ids) == 2 and out.log_probs is None and out.stop_reason == "completed"
        asyncio.run(server.sleep())
        assert server.llm.asleep
        asyncio.run(server.wake_up(["weights"]))  # verl's worker: weights first, the KV cache after the push
        assert server.llm.asleep
        asyncio.run(server.wake_up(["kv_cache"]))
        assert not server.llm.asleep
        out = asyncio.run(server.generate([5, 6, 7], verls | {"max_tokens": 2}, "b"))
        assert len(out.log_probs) == len(out.token_ids) == 2
    finally:
        server.engine.close()
