"""`samebits rl`: the closed loop stays bitwise on-policy, and every check in it can fail."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from samebits import rl
from samebits.cli import main
from samebits.engine.digest import tensor_digest
from samebits.rl.batching import pack_micro_batches, split_mini_batches
from samebits.rl.loop import RLLoop

BITWISE = ("rollout_logprobs_mismatch_count", "old_logprobs_mismatch_count", "digest_mismatch_count")


def _cfg(tiny, **kw) -> rl.RLConfig:
    return rl.RLConfig(model=str(tiny), **kw)


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time_")}


def _trainer_digests(loop: RLLoop) -> dict[str, str]:
    return {n: tensor_digest(p) for n, p in loop.model.named_parameters()}


# -- the loop end to end ---------------------------------------------------------------------


def test_cli_default_run_is_bitwise_every_step_and_the_toy_reward_rises(tmp_path, monkeypatch):
    monkeypatch.setenv("SAMEBITS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["rl", "--out", str(out), "--no-live"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10))  # 10 steps: in 5 the rise depended on the CPU
    for r in rows:
        assert all(r[k] == 0 for k in BITWISE), r
        assert r["rollout_logprobs_tokens"] > 0 and r["old_logprobs_tokens"] > 0
        assert r["digests_checked"] == 36  # every tiny parameter: 3 + 3 layers x 11
        # an update moves the weights exactly when some advantage is nonzero (every group's
        # rewards equal: all advantages 0, and so the gradient; the toy task can be solved in 10 steps)
        assert math.isfinite(r["grad_norm"]) and (r["grad_norm"] > 0) == (r["advantage_abs_max"] > 0), r
    rewards = [r["reward_mean"] for r in rows]
    assert rewards[-1] > rewards[0] + 0.1, rewards  # the updates reach the engine and help
    assert sum(r["grad_norm"] > 0 for r in rows) >= 5  # most steps did update
    assert (out / "metrics.png").stat().st_size > 0 and (out / "checkpoint.pt").is_file()


def test_forced_max_length_grpo_small_micro_batches_is_bitwise(tiny):
    cfg = _cfg(tiny, algorithm="grpo", steps=2, force_max_length=True, max_tokens=20, micro_batch_tokens=64)
    rows = rl.run(cfg, live=False)
    assert rl.passed(rows)
    for r in rows:
        assert r["response_len_min"] == r["response_len_max"] == 20
        assert r["rollout_logprobs_tokens"] == cfg.num_sequences * 20


def test_negative_control_grouped_mm_trainer_experts_mismatches(tmp_path, tiny):
    rows = rl.run(_cfg(tiny, steps=1, trainer_experts="grouped_mm"), live=False)
    assert rows[0]["rollout_logprobs_mismatch_count"] > 0 and rows[0]["diff_max"] > 0
    assert not rl.passed(rows)
    # the CLI reports it and exits nonzero instead of crashing
    argv = ["rl", "--model", str(tiny), "--steps", "1", "--trainer-experts", "grouped_mm"]
    assert main(argv + ["--out", str(tmp_path / "neg"), "--no-live"]) == 1


def test_negative_control_stock_update_kernels_mismatch_the_old_logprobs(tiny):
    row = RLLoop(_cfg(tiny, update_kernels="stock")).step()
    assert row["rollout_logprobs_mismatch_count"] == 0  # the recompute is still batch invariant
    assert row["old_logprobs_mismatch_count"] > 0


def test_stock_recompute_kernels_mismatch_the_rollout(tiny):
    row = RLLoop(_cfg(tiny, recompute_kernels="stock")).step()
    assert row["rollout_logprobs_mismatch_count"] > 0


def test_stock_baseline_reaches_engine_and_trainer(tiny):
    """The arm benchmarks/rl_step.py prices exactness against: every piece stock."""
    loop = RLLoop(
        _cfg(
            tiny,
            engine_numerics="fast",
            trainer_experts="grouped_mm",
            trainer_attention="sdpa",
            recompute_kernels="stock",
            update_kernels="stock",
        )
    )
    assert loop.llm.runner.profile.name == "fast"
    assert loop.model.config._attn_implementation == "sdpa"
    row = loop.step()
    assert row["rollout_logprobs_mismatch_count"] > 0 and row["digest_mismatch_count"] == 0


def test_shared_weights_keep_one_copy_and_run_the_synced_loop_bit_for_bit(tiny):
    shared = RLLoop(_cfg(tiny, share_weights=True))
    engine = dict(shared.llm.model.named_parameters(remove_duplicate=False))
    owner = dict(shared.model.named_parameters(remove_duplicate=False))
    assert engine.keys() == owner.keys()
    assert all(engine[n].data_ptr() == owner[n].data_ptr() for n in engine)  # one copy of the model
    synced = RLLoop(_cfg(tiny))
    for _ in range(3):  # the optimizer steps reach the engine with no copy, and the same bits
        a, b = shared.step(), synced.step()
        assert _untimed(a) == _untimed(b) and all(a[k] == 0 for k in BITWISE)
    # negative control: shared weights under stock trainer experts still mismatch
    neg = RLLoop(_cfg(tiny, share_weights=True, trainer_experts="grouped_mm")).step()
    assert neg["rollout_logprobs_mismatch_count"] > 0


def test_freezing_the_experts_keeps_them_and_syncs_the_rest(tiny):
    loop = RLLoop(_cfg(tiny, freeze=("experts",)))
    before = _trainer_digests(loop)
    assert not any("mlp.experts" in n for n, _ in loop.trainable)
    row = loop.step()
    assert all(row[k] == 0 for k in BITWISE)
    after = _trainer_digests(loop)
    changed = {n for n in before if before[n] != after[n]}
    assert changed and not any("mlp.experts" in n for n in changed)
    assert {n for n in before if "mlp.experts" in n} and "lm_head.weight" in changed


# -- faults ----------------------------------------------------------------------------------


def test_digest_check_catches_one_ulp_that_was_not_synced(tiny):
    loop = RLLoop(_cfg(tiny))
    assert loop.digest_mismatches() == []
    p = dict(loop.model.named_parameters())["model.norm.weight"]
    with torch.no_grad():
        p[0] = torch.nextafter(p[0], torch.tensor(10.0, dtype=p.dtype))
    assert loop.digest_mismatches() == ["model.norm.weight"]
    loop.sync_weights()
    assert loop.digest_mismatches() == []


@pytest.mark.parametrize("fault", ["name", "shape", "dtype"])
def test_bad_weight_update_is_rejected_whole_and_the_loop_goes_on(tiny, fault):
    loop = RLLoop(_cfg(tiny))
    loop.step()
    engine_before = loop.llm.weight_digests()
    params = list(loop.model.named_parameters())

    def stream():  # good (changed) tensors first, the bad one last: a partial apply would show
        for name, p in params[:3]:
            yield name, p.detach() + 1
        name, p = params[3]
        bad = {
            "name": (name + ".typo", p.detach()),
            "shape": (name, p.detach()[:1]),
            "dtype": (name, p.detach().float()),
        }
        yield bad[fault]

    with pytest.raises((KeyError, ValueError), match="update_weights"):
        loop.llm.update_weights(stream())
    assert loop.llm.weight_digests() == engine_before
    assert loop.digest_mismatches() == []
    row = loop.step()
    assert all(row[k] == 0 for k in BITWISE)


def _reward_module(tmp_path, monkeypatch, body: str) -> str:
    (tmp_path / "my_rewards.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # each case imports its own
    return "my_rewards:reward"


@pytest.mark.parametrize(
    "body,match",
    [
        ("def reward(p, r):\n    raise ZeroDivisionError('oops')\n", "raised ZeroDivisionError: oops"),
        ("def reward(p, r):\n    return [0.5]\n", "returned 1 values for 16 responses"),
        ("def reward(p, r):\n    return [float('nan')] * len(r)\n", "returned nan for response 0"),
    ],
)
def test_failing_reward_stops_the_step_and_leaves_no_half_applied_state(
    tiny, tmp_path, monkeypatch, body, match
):
    spec = _reward_module(tmp_path, monkeypatch, body)
    loop = RLLoop(_cfg(tiny, reward=spec))
    loop.step_count = 3
    trainer_before, engine_before = _trainer_digests(loop), loop.llm.weight_digests()
    with pytest.raises(rl.RewardError, match=f"reward 'my_rewards:reward' {match}"):
        loop.step()
    assert loop.step_count == 3
    assert loop.optimizer.state_dict()["state"] == {}  # no optimizer step was taken
    assert _trainer_digests(loop) == trainer_before and loop.llm.weight_digests() == engine_before
    assert not loop.llm.asleep
    loop.reward_fn = rl.toy_reward  # the engine and trainer are still usable
    assert all(loop.step()[k] == 0 for k in BITWISE)


def test_builtin_rewards_by_hand():
    assert rl.toy_reward([[1]] * 3, [[8, 3, 16, 5], [1], []]) == [0.5, 0.0, 0.0]
    h = rl.hash_reward([[1, 2], [1, 2]], [[3], [4]])
    assert h == rl.hash_reward([[1, 2], [1, 2]], [[3], [4]]) and h[0] != h[1]
    assert all(0 <= v < 1 for v in h)


def test_cli_reports_bad_options_and_a_failing_reward_without_a_traceback(tiny, tmp_path, monkeypatch, capsys):
    base = ["rl", "--model", str(tiny), "--out", str(tmp_path / "o"), "--no-live", "--steps", "1"]
    assert main(base + ["--n", "1"]) == 2
    assert "n must be an int >= 2, got 1" in capsys.readouterr().err
    assert main(base + ["--freeze", "nothing_like_this"]) == 2
    assert "'nothing_like_this' matches no parameter" in capsys.readouterr().err
    spec = _reward_module(tmp_path, monkeypatch, "def reward(p, r):\n    raise KeyError('x')\n")
    assert main(base + ["--reward", spec]) == 1
    assert "reward 'my_rewards:reward' raised KeyError" in capsys.readouterr().err


def test_reward_spec_errors_name_the_missing_piece():
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        rl.load_reward("no_such_mod:f")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        rl.load_reward("math:nope")
    assert rl.load_reward("math:fsum") is math.fsum


@pytest.mark.parametrize("shared", [False, True])
def test_checkpoint_resume_continues_bitwise_like_an_uninterrupted_run(tiny, tmp_path, shared):
    cfg = _cfg(tiny, share_weights=shared)
    straight = RLLoop(cfg)
    rows = [straight.step() for _ in range(3)]

    first = RLLoop(cfg)
    assert [_untimed(first.step()) for _ in range(2)] == [_untimed(r) for r in rows[:2]]
    ckpt = first.save_checkpoint(tmp_path / "ckpt.pt")
    resumed = RLLoop(cfg)
    resumed.load_checkpoint(ckpt)
    assert resumed.step_count == 2
    row = resumed.step()
    assert all(row[k] == 0 for k in BITWISE)
    assert _untimed(row) == _untimed(rows[2])
    assert _trainer_digests(resumed) == _trainer_digests(straight)
    assert resumed.llm.weight_digests() == straight.llm.weight_digests()

    # negative control: resuming without the optimizer state gives other weights
    fresh_opt = RLLoop(cfg)
    state = torch.load(ckpt, weights_only=False)
    fresh_opt.model.load_state_dict(state["model"])
    fresh_opt.step_count = 2
    fresh_opt.sync_weights()
    fresh_opt.step()
    assert _trainer_digests(fresh_opt) != _trainer_digests(straight)


def test_run_resume_appends_to_the_log(tiny, tmp_path):
    out = tmp_path / "run"
    rl.run(_cfg(tiny, steps=1, out_dir=str(out)), live=False)
    rows = rl.run(_cfg(tiny, steps=1, out_dir=str(out)), live=False, resume=out / rl.CHECKPOINT)
    assert rows[0]["step"] == 1 and rl.passed(rows)
    log = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert log == [0, 1]


# -- colocation ------------------------------------------------------------------------------


def test_sleeping_engine_releases_its_kv_cache_and_refuses_to_generate(tiny):
    import samebits

    llm = samebits.LLM(tiny, max_num_seqs=2, max_model_len=64)
    sp = samebits.SamplingParams(max_tokens=6, seed=3)
    a = llm.generate([[5, 6, 7]], sp)[0]
    llm.sleep()
    assert llm.runner.kv_caches == []
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([[5, 6, 7]], sp)
    assert llm.weight_digests(["lm_head.weight"])  # weights stay usable
    llm.wake_up()
    b = llm.generate([[5, 6, 7]], sp)[0]
    assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)


# -- pieces ----------------------------------------------------------------------------------


def test_group_advantages_by_hand():
    adv = rl.group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), n=2, eps=0.0)
    s = math.sqrt(0.5)  # sample std of (1, 0)
    assert torch.allclose(adv, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]))
    with pytest.raises(ValueError, match="multiple of n=3"):
        rl.group_advantages(torch.zeros(4), n=3)


def test_grpo_and_gspo_losses_by_hand():
    old = [torch.zeros(2)]
    new = [torch.tensor([math.log(1.1), math.log(0.9)], requires_grad=True)]
    pos = torch.tensor([1.0])
    # GRPO: token ratios 1.1, 0.9. eps 0.2: nothing clipped -> -(1.1 + 0.9) / 2
    loss, frac = rl.grpo_losses(new, old, pos, eps=0.2)
    assert loss.item() == pytest.approx(-1.0) and frac.item() == 0.0
    # eps 0.05, A = +1: 1.1 clipped to 1.05, 0.9 kept -> -(1.05 + 0.9) / 2, half the tokens clipped
    loss, frac = rl.grpo_losses(new, old, pos, eps=0.05)
    assert loss.item() == pytest.approx(-0.975) and frac.item() == 0.5
    # eps 0.05, A = -1: min(-r, -clip(r)): 1.1 kept (-1.1), 0.9 clipped to 0.95 (-0.95)
    loss, _ = rl.grpo_losses(new, old, -pos, eps=0.05)
    assert loss.item() == pytest.approx((1.1 + 0.95) / 2)
    # GSPO: one ratio exp(mean log r) = sqrt(1.1 * 0.9) = sqrt(0.99), inside 1 +- 0.05
    loss, frac = rl.gspo_losses(new, old, pos, eps=0.05)
    assert loss.item() == pytest.approx(-math.sqrt(0.99)) and frac.item() == 0.0
    loss.backward()  # d/d new_t of -exp(mean(new)) = -s / L for every token
    assert torch.allclose(new[0].grad, torch.full((2,), -math.sqrt(0.99) / 2))
    # GSPO clips the whole sequence: with eps 1e-3 the ratio 0.99499 is below 1 - eps -> for A = -1
    # min(-s, -(1 - eps)) = -(0.999): clipped, constant, no gradient
    new[0].grad = None
    loss, frac = rl.gspo_losses(new, old, -pos, eps=1e-3)
    assert loss.item() == pytest.approx(0.999) and frac.item() == 1.0
    loss.backward()
    assert torch.equal(new[0].grad, torch.zeros(2))
    with pytest.raises(ValueError, match="sequence 0"):
        rl.gspo_losses([torch.zeros(2)], [torch.zeros(3)], pos, eps=0.2)


def test_micro_batches_respect_the_budget_and_cover_every_sequence():
    lengths = [30, 10, 25, 5, 40, 70]
    micro = pack_micro_batches(range(6), lengths, 50)
    assert sorted(i for m in micro for i in m) == list(range(6))
    assert all(sum(lengths[i] for i in m) <= 50 for m in micro if len(m) > 1)
    assert [5] in micro  # longer than the budget: alone
    assert split_mini_batches(10, 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(algorithm="ppo"), "algorithm must be one of"),
        (dict(n=1), "n must be an int >= 2"),
        (dict(mini_batches=17), r"mini_batches \(17\) must be <= num_prompts \* n \(16"),
        (dict(lr=-1.0), "lr must be a finite number >= 0"),
        (dict(trainer_experts="sdpa"), "trainer_experts must be one of"),
        (dict(trainer_attention="flash"), "trainer_attention must be one of"),
        (dict(engine_numerics="turbo"), "engine_numerics must be one of"),
        (dict(recompute_kernels="cublas"), "recompute_kernels must be one of"),
        (dict(share_weights="yes"), "share_weights must be True or False"),
        (dict(freeze="experts"), "freeze must be a tuple"),
        (dict(reward="nomodule"), "reward must be 'toy', 'hash' or 'module:function'"),
        (dict(clip_eps=0), "clip_eps must be a finite number > 0"),
    ],
)
def test_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        rl.RLConfig(**kw)


def test_freeze_that_matches_nothing_or_everything_is_refused(tiny):
    with pytest.raises(ValueError, match="'nonexistent' matches no parameter"):
        RLLoop(_cfg(tiny, freeze=("nonexistent",)))
    with pytest.raises(ValueError, match="freezes every parameter"):
        RLLoop(_cfg(tiny, freeze=("model", "lm_head")))


@pytest.mark.parametrize("shape", ["tied_top1", "bias_per_expert"])
def test_other_shapes_are_bitwise_and_their_control_mismatches(checkpoints, shape):
    # tied embeddings (lm_head.weight digested through its tie), attention bias, per-expert layout
    row = RLLoop(rl.RLConfig(model=str(checkpoints[shape]), steps=1)).step()
    assert all(row[k] == 0 for k in BITWISE) and row["digests_checked"] > 0
    neg = RLLoop(rl.RLConfig(model=str(checkpoints[shape]), trainer_experts="grouped_mm")).step()
    assert neg["rollout_logprobs_mismatch_count"] > 0


def test_engine_sleeps_while_the_trainer_steps(tiny, monkeypatch):
    loop = RLLoop(_cfg(tiny))
    seen = []
    update = loop._update

    def spy(*args):
        seen.append((loop.llm.asleep, list(loop.llm.runner.kv_caches)))
        return update(*args)

    monkeypatch.setattr(loop, "_update", spy)
    loop.step()
    assert seen == [(True, [])]
    assert not loop.llm.asleep and loop.llm.runner.kv_caches
