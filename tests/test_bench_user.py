"""`samebits bench`'s measurements through `LLM.generate`, run on the tiny model on the CPU:
the shapes and fields of what they return, the schedule the decode timing relies on, and
the table / JSON / CSV that carry them. No timing assertions: durations are positive, and
a difference of two times is only checked to be present (it can be <= 0 at these sizes)."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics

import pytest
from rich.console import Console

from samebits import bench
from samebits.bench import generate as bench_generate
from samebits.bench import report as bench_report
from samebits.engine.llm import LLM


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, device="cpu", max_num_seqs=4, max_model_len=64)


def _steps_of(llm, monkeypatch) -> list[tuple[int, ...]]:
    """Records each engine step as the sorted token counts of its chunks (1 = a decode row)."""
    steps, launch = [], llm.runner.launch

    def recording(batch, reqs, ahead=None):
        steps.append(tuple(sorted(c.num_tokens for c in batch.chunks)))
        return launch(batch, reqs, ahead)

    monkeypatch.setattr(llm.runner, "launch", recording)
    return steps


def _is_inserted_decodes(short, long, batch, extra) -> bool:
    """long == short with `extra` full-batch decode steps inserted at one place."""
    decode = (1,) * batch
    return any(
        long[:k] == short[:k] and long[k : k + extra] == [decode] * extra and long[k + extra :] == short[k:]
        for k in range(len(short) + 1)
    )


@pytest.mark.parametrize("batch,context,budget", [(4, 8, 16), (3, 20, 24), (1, 30, 16)])
def test_extra_tokens_past_first_are_full_batch_decode_steps(tiny, monkeypatch, batch, context, budget):
    # the claim decode_ms rests on: a call with `first + extra` max_tokens runs the steps of the
    # call with `first` plus `extra` steps of all `batch` rows decoding, and nothing else
    llm = LLM(tiny, device="cpu", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=budget)
    prompts = bench_generate.random_prompts(llm.config.vocab_size, batch, context, seed=0)
    first, extra = bench_generate.first_decode_tokens(batch, context, budget), 3
    runs = []
    for max_tokens in (1, 1 + extra, first, first + extra):
        steps = _steps_of(llm, monkeypatch)
        bench_generate.timed_generate(llm, prompts, max_tokens)
        runs.append(list(steps))
        monkeypatch.undo()
    assert _is_inserted_decodes(runs[2], runs[3], batch, extra)
    if batch > 1 and batch * context > budget:  # negative control: prompts prefilled in several
        assert not _is_inserted_decodes(runs[0], runs[1], batch, extra)  # steps, so from max_tokens=1
        # the early rows' extra decodes ride along with the later prefills


def test_measure_generate_fields(llm):
    g = bench_generate.measure_generate(llm, batch=3, context=10, extra=2)
    assert (g.batch, g.context, g.last - g.first) == (3, 10, max(2, g.first))
    assert g.first == bench_generate.first_decode_tokens(3, 10, llm.engine.resolved_batched_tokens())
    assert min(g.prefill_s, g.first_s, g.last_s) > 0
    assert g.prefill_tok_s == 3 * 10 / g.prefill_s
    assert g.decode_tok_s == pytest.approx(1000 * 3 / g.decode_ms)
    assert len(g.step_s) >= g.last - g.first and g.decode_ms == 1000 * statistics.median(g.step_s)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_timed_decode_steps_records_exactly_the_full_batch_decode_steps(tiny, monkeypatch, async_scheduling):
    # decode_ms is the median of these: the steps in which all B rows decode one token each
    # (the ones the test above counts), and no other step, whether steps are launched ahead or not
    kw = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=24, async_scheduling=async_scheduling)
    llm = LLM(tiny, device="cpu", **kw)
    prompts = bench_generate.random_prompts(llm.config.vocab_size, 3, 20, seed=0)
    steps = _steps_of(llm, monkeypatch)
    seconds, timed = bench_generate.timed_decode_steps(llm, prompts, 9)
    assert seconds > 0 and all(t > 0 for t in timed)
    assert len(timed) == steps.count((1, 1, 1)) >= 9 - bench_generate.first_decode_tokens(3, 20, 24)
    assert not llm.core.has_unfinished()


def test_measure_generate_refuses_no_extra_steps(llm):
    with pytest.raises(ValueError, match="extra"):
        bench_generate.measure_generate(llm, batch=1, context=4, extra=0)


def test_timed_generate_checks_every_request_ran_to_max_tokens(llm, monkeypatch):
    prompts = bench_generate.random_prompts(llm.config.vocab_size, 2, 5, seed=1)
    assert bench_generate.timed_generate(llm, prompts, 3) > 0
    generate = llm.generate

    def short(prompts, params, progress=None):  # a request that stopped early (eos) would skew the time
        outs = generate(prompts, params, progress)
        outs[0].token_ids = outs[0].token_ids[:-1]
        return outs

    monkeypatch.setattr(llm, "generate", short)
    with pytest.raises(RuntimeError, match="asked for 3 tokens per request, got \\[2, 3\\]"):
        bench_generate.timed_generate(llm, prompts, 3)


def test_measure_rollout(llm):
    r = bench_generate.measure_rollout(llm, requests=5, prompt_len=6, new_tokens=4)
    assert (r.requests, r.prompt_len, r.new_tokens) == (5, 6, 4)  # 5 > max_num_seqs: queued
    assert r.seconds > 0 and r.output_tok_s == 5 * 4 / r.seconds


def test_engine_limits_fit_every_measurement(tiny):
    batches, context, extra, rollout = (1, 4), 12, 5, (6, 7, 9)
    limits = bench.engine_limits(batches, context, extra, rollout)
    assert limits["max_num_seqs"] == 6
    llm = LLM(tiny, device="cpu", **limits)
    budget = llm.engine.resolved_batched_tokens()
    for b in batches:  # measure_generate times max(extra, first) decode steps after `first`
        first = bench_generate.first_decode_tokens(b, context, budget)
        assert context + first + max(extra, first) <= limits["max_model_len"]
    assert limits["max_model_len"] >= 7 + 9


def _result(llm) -> bench_report.BenchResult:
    result = bench_report.BenchResult(meta={"device": "cpu"})
    for arm in ("exact", "fast"):
        result.rows += bench.measure_engine_arm(llm, arm, (1, 2), 8, 2, 2, bandwidth=1e12, log=lambda _: None)
        result.rollout[arm] = bench.measure_rollout_arm(llm, arm, (3, 5, 4), log=lambda _: None)
    result.trainer_ms = {bench_report.EXACT_TRAINER: 2.0, bench_report.STOCK_TRAINER: 1.0}
    result.rl_step = {"on_policy_s": 3.0, "stock_s": 2.0, "ratio": 1.5, "steps": 3, "shape": "8 x 4 (8 -> 128)"}
    return result


def test_engine_arm_rows_carry_generate_step_and_floor(llm):
    result = _result(llm)
    assert [(r.arm, r.batch) for r in result.rows] == [("exact", 1), ("exact", 2), ("fast", 1), ("fast", 2)]
    for r in result.rows:
        assert min(r.step_ms, r.prefill_tok_s, r.floor_ms, r.tokens_per_s) > 0  # durations and rates
        # generate_ms is a difference of two wall times; at the tiny model's sizes it can come
        # out at or below 0 (measured: -0.45 ms in CI), so only its presence is checked here
        assert math.isfinite(r.generate_ms)
        assert r.replay_ms is None  # no CUDA graphs on the CPU
    assert set(result.rollout) == {"exact", "fast"}
    assert result.rollout["fast"]["output_tok_s"] == 3 * 4 / result.rollout["fast"]["seconds"]


def test_table_json_and_csv_carry_the_new_measures(llm, tmp_path):
    result = _result(llm)
    console = Console(file=io.StringIO(), width=200)
    bench_report.print_table(result, console)
    text = console.file.getvalue()
    for measure in ("decode through generate", "engine step", "prefill through generate", "memory floor"):
        assert measure in text
    assert "3 x (5 -> 4)" in text and "RL step" in text and "8 x 4 (8 -> 128)" in text
    assert "1.50x" in text and "2.00x" in text  # RL step and trainer: exact (on-policy) over fast (stock)
    written = bench_report.write_outputs(result, tmp_path)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["rl_step"]["ratio"] == 1.5 and data["rollout"]["exact"]["requests"] == 3
    for row in data["decode"]:
        assert {"generate_ms", "generate_tokens_per_s", "prefill_tok_s", "replay_ms", "step_ms"} <= set(row)
    lines = list(csv.DictReader((tmp_path / "bench.csv").open()))
    assert len(lines) == 4 and float(lines[0]["generate_ms"]) == result.rows[0].generate_ms
    assert written[:2] == [tmp_path / "bench.json", tmp_path / "bench.csv"]


def test_exact_over_fast_inverts_rates():
    assert bench_report.exact_over_fast([10.0, 5.0, None], "ms") == "2.00x"
    assert bench_report.exact_over_fast([5.0, 10.0, None], "tok/s") == "2.00x"
    assert bench_report.exact_over_fast([None, 10.0, None], "ms") == ""


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--generate-steps", "-1"], "--generate-steps"),
        (["--input-len", "0"], "--input-len"),
        (["--num-prompts", "x"], "--num-prompts"),
        (["--arms", ""], "--arms"),  # nothing to run: empty arms only with --rl
    ],
)
def test_bench_cli_refuses_bad_user_flags(argv, field, tmp_path, capsys):
    from samebits.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--dir", str(tmp_path / "ckpt"), *argv])
    assert exit_.value.code == 2
    assert field in capsys.readouterr().err


def test_bench_cli_runs_the_rl_arms_before_this_process_holds_gpu_memory(tiny, tmp_path, monkeypatch):
    """`--rl` runs its arms (each in its own process) before the engine and trainer arms load
    anything here: on the H200 at 48 layers an RL run after them was refused memory that this
    process kept cached. The partial JSON written after each arm carries the RL result."""
    import torch

    from samebits.cli import main
    from samebits.rl import arms as rl_arms

    calls = []
    ratio = {"on_policy_s": 1.0, "stock_s": 1.0, "ratio": 1.0, "steps": 1, "shape": "s"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rl_arms, "bench_ratio", lambda model, steps: calls.append("rl") or ratio)

    def run(model, on_progress, **kw):
        calls.append("arms")
        result = bench.BenchResult(meta={"device": "d", "copy_GBps": 1.0, "model": str(model)})
        on_progress(result)
        assert json.loads((tmp_path / "out" / "bench.json").read_text())["rl_step"] == ratio
        return result

    monkeypatch.setattr(bench, "run", run)
    assert main(["bench", "--model", str(tiny), "--arms", "exact", "--rl", "--out", str(tmp_path / "out")]) == 0
    assert calls == ["rl", "arms"]
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["rl_step"] == ratio


def test_rl_step_ratio_of_the_on_policy_and_stock_loops(tiny):
    from samebits.rl import arms as bench_rl

    r = bench_rl.bench_ratio(tiny, 2, device="cpu", spawn=False, num_prompts=2, n=2, max_tokens=4)
    assert r["shape"] == "2 x 2 (8 -> 4)" and r["steps"] == 2
    assert min(r["on_policy_s"], r["stock_s"]) > 0
    assert r["ratio"] == r["on_policy_s"] / r["stock_s"]


def test_rl_arms_warm_up_run_is_thrown_away(tiny):
    from samebits.rl import RLConfig
    from samebits.rl import arms as bench_rl

    lines = []
    cfg = RLConfig(model=str(tiny), device="cpu", steps=2, num_prompts=2, n=2, max_tokens=4)
    results = bench_rl.run_arms(cfg, ("stock",), spawn=False, log=lines.append, warmup_steps=1)
    assert list(results) == ["stock"] and [r["step"] for r in results["stock"]] == [0, 1]
    assert lines[0].startswith("warm-up run of stock, 1 steps") and sum(" step 0:" in x for x in lines) == 2


def test_rl_arms_rounds_alternate_the_order_and_tag_each_run(tiny, monkeypatch):
    """rounds=3 runs A B, B A, A B (each arm's rows tagged with their round, in run order);
    rounds=0 is refused."""
    from samebits.rl import RLConfig
    from samebits.rl import arms as bench_rl

    order = []

    def fake_run(config, spawn, log):
        arm = "stock" if config.engine_numerics == "fast" else "on-policy"
        order.append(arm)
        return [{"step": i, "arm": arm} for i in range(config.steps)]

    monkeypatch.setattr(bench_rl, "_run_in", fake_run)
    cfg = RLConfig(model=str(tiny), device="cpu", steps=2)
    results = bench_rl.run_arms(cfg, ("on-policy", "stock"), spawn=False, log=lambda _: None, rounds=3)
    assert order == ["on-policy", "stock", "stock", "on-policy", "on-policy", "stock"]
    for arm in ("on-policy", "stock"):
        want = [(k, i, arm) for k in range(3) for i in range(2)]
        assert [(r["round"], r["step"], r["arm"]) for r in results[arm]] == want
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        bench_rl.run_arms(cfg, ("stock",), spawn=False, rounds=0)


def test_rl_medians_skip_each_runs_first_step_and_ratios_are_per_round():
    """Each run's first step (compile, capture) is left out of the medians, whatever round it is
    in; a round's ratio uses only its own runs. Control: without the round tags the second
    run's slow first step counts."""
    from samebits.rl import arms as bench_rl

    def run(k, first, rest, n=3):
        times = [first] + [rest] * (n - 1)
        return [{"round": k, **{f"time_{p}_s": t for p in bench_rl.PHASES}} for t in times]

    on = run(0, 50.0, 2.0) + run(1, 50.0, 3.0)
    stock = run(0, 40.0, 2.0) + run(1, 40.0, 2.0)
    assert bench_rl.medians(on)["step"] == 2.5  # median of 2, 2, 3, 3
    assert bench_rl.round_ratios({"on-policy": on, "stock": stock}) == [1.0, 1.5]
    untagged = [{k: v for k, v in r.items() if k != "round"} for r in on]
    assert bench_rl.medians(untagged)["step"] == 3.0  # 2, 2, 50, 3, 3: the second run's first step counts


def test_rl_arms_refuse_an_unknown_arm(tiny):
    from samebits.rl import RLConfig
    from samebits.rl import arms as bench_rl

    with pytest.raises(ValueError, match="unknown \\['stok'\\]"):
        bench_rl.run_arms(RLConfig(model=str(tiny)), ("on-policy", "stok"), spawn=False)


@pytest.mark.gpu
def test_bench_cli_on_cuda_writes_every_measure(tiny, tmp_path, capsys):
    # the whole CUDA path at tiny sizes: engine steps with graph replays, generate, rollout, RL
    from samebits.cli import main

    out = tmp_path / "out"
    argv = ["bench", "--model", str(tiny), "--batches", "1,2", "--context", "16", "--arms", "exact,fast"]
    argv += ["--steps", "2", "--generate-steps", "2", "--num-prompts", "3", "--input-len", "8"]
    argv += ["--output-len", "4", "--rl", "--rl-steps", "2", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    assert [(r["arm"], r["batch"]) for r in data["decode"]] == [
        ("exact", 1),
        ("exact", 2),
        ("fast", 1),
        ("fast", 2),
    ]
    for r in data["decode"]:
        assert min(r["step_ms"], r["replay_ms"], r["prefill_tok_s"]) > 0
        assert math.isfinite(r["generate_ms"]) and r["generate_ms"] > 0  # the median full-batch step
    assert {a: r["requests"] for a, r in data["rollout"].items()} == {"exact": 3, "fast": 3}
    assert data["rl_step"]["shape"] == "8 x 4 (8 -> 128)" and data["rl_step"]["ratio"] > 0
    assert "rollout through generate" in capsys.readouterr().out


def test_timed_decode_steps_are_raised_to_the_prefill_phase(llm, monkeypatch):
    # the difference of two calls (and the last call's full-batch steps): the inserted steps
    # are at least the prefill phase's, so the difference is not a small part of either call
    asked = []

    def timed(_, prompts, max_tokens, seed=0):  # what was asked, not run
        asked.append(max_tokens)
        return 1.0

    def stepped(_, prompts, max_tokens, seed=0):  # the last call: its steps timed too
        asked.append(max_tokens)
        return 1.0, [0.01]

    monkeypatch.setattr(bench_generate, "warm_generate", lambda _, p, n, seed=0: asked.append(f"warm {n}"))
    monkeypatch.setattr(bench_generate, "timed_generate", timed)
    monkeypatch.setattr(bench_generate, "timed_decode_steps", stepped)
    monkeypatch.setattr(bench_generate, "first_decode_tokens", lambda *a: 7)
    g = bench_generate.measure_generate(llm, batch=2, context=4, extra=3)
    assert asked == ["warm 1", "warm 7", "warm 14", 1, 7, 14] and (g.first, g.last) == (7, 14)
    asked.clear()
    g = bench_generate.measure_generate(llm, batch=2, context=4, extra=9)
    assert asked == ["warm 1", "warm 7", "warm 16", 1, 7, 16] and (g.first, g.last) == (7, 16)


def test_a_run_stopped_part_way_keeps_what_it_measured(tmp_path, monkeypatch):
    """`bench.run` hands the result so far to `on_progress` after each arm's decode points and
    each rollout; written as the CLI writes it, a run stopped in the fast arm's rollout (here an
    interrupt where a kill would land) leaves bench.json with both arms' decode rows, the exact
    rollout and `complete: false`, and no temporary file. The CUDA measurements are stand-ins:
    the control flow and the files are what is checked."""
    from samebits.bench import core

    monkeypatch.setattr(core.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(core.torch.cuda, "get_device_name", lambda dev: "stand-in")
    monkeypatch.setattr(core, "copy_bandwidth", lambda dev: 1e12)
    monkeypatch.setattr(core, "engine_limits", lambda *a: {})
    monkeypatch.setattr(core, "free_memory", lambda: None)

    class Engine:
        def __init__(self, model, **kw):
            self.core = type("Core", (), {"async_scheduling": True})()
            self.engine = type("Config", (), {"resolved_batched_tokens": lambda self: 8192})()

    monkeypatch.setattr("samebits.engine.llm.LLM", Engine)
    monkeypatch.setattr(
        core,
        "measure_engine_arm",
        lambda llm, arm, batches, *a: [bench_report.Row(arm, b, 16, 2.0, 500.0, 1.0) for b in batches],
    )

    def rollout(llm, arm, shape, log):
        if arm == "fast":
            raise KeyboardInterrupt  # stopped here
        return {"requests": shape[0], "seconds": 1.0, "output_tok_s": 4.0}

    monkeypatch.setattr(core, "measure_rollout_arm", rollout)

    def partial(result):
        result.meta["complete"] = False
        bench_report.write_outputs(result, tmp_path, plot=False)

    with pytest.raises(KeyboardInterrupt):
        core.run(
            "ckpt",
            batches=(1, 4),
            arms=("exact", "fast"),
            rollout=(2, 3, 4),
            log=lambda *a: None,
            on_progress=partial,
        )
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["meta"]["complete"] is False
    assert [(r["arm"], r["batch"]) for r in data["decode"]] == [
        ("exact", 1),
        ("exact", 4),
        ("fast", 1),
        ("fast", 4),
    ]
    assert list(data["rollout"]) == ["exact"]
    assert len(list(csv.DictReader((tmp_path / "bench.csv").open()))) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.csv", "bench.json"]
