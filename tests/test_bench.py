"""`samebits bench`: the memory floor it reports, and a clear refusal without CUDA."""

from __future__ import annotations

import pytest
import torch

from samebits import bench
from samebits.model.qwen3_moe.config import ModelConfig


def _cfg(**kw):
    d = dict(bench.QWEN3_30B_A3B, num_hidden_layers=48, architectures=["Qwen3MoeForCausalLM"]) | kw
    return ModelConfig.from_dict(d)


def test_step_bytes_by_hand_at_batch_one():
    cfg = _cfg()
    attn = 2048 * 128 * (2 * 32 + 2 * 4)  # q, o and k, v projections
    experts = 8 * 3 * 2048 * 768  # top-8 of 128: 1 - (1 - 8/128)**1 of 128 experts = 8
    router = 128 * 2048
    kv = 1024 * 2 * 4 * 128
    want = 2 * (48 * (attn + experts + router + kv) + 151936 * 2048 + 2048)
    assert bench.step_bytes(cfg, 1, 1024) == pytest.approx(want, rel=1e-12)


def test_step_bytes_saturate_at_all_experts():
    cfg = _cfg()
    grown = bench.step_bytes(cfg, 4096, 0) - bench.step_bytes(cfg, 2048, 0)
    assert grown == pytest.approx(2 * 2048 * 2048, rel=1e-3)  # only the hidden rows grow


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_refuses_without_cuda(tmp_path):
    with pytest.raises(RuntimeError, match="no CUDA device"):
        bench.run(tmp_path, arms=("exact",))


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--arms", "exact,fsat"], "--arms"),
        (["--batches", "1,x"], "--batches"),
        (["--hf-batches", "0"], "--hf-batches"),
    ],
)
def test_bench_cli_names_the_bad_option_before_any_work(argv, field, tmp_path, capsys):
    from samebits.cli import main

    with pytest.raises(SystemExit) as exit_:  # exit status 2, one line naming the option
        main(["bench", "--dir", str(tmp_path / "ckpt"), *argv])
    assert exit_.value.code == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()  # refused before the checkpoint is written


def test_row_log_rewrites_its_json_after_every_row(tmp_path):
    """`RowLog` (the benchmarks' partial results): after each row the file holds the meta and
    every row so far, and no temporary file is left; without a path it writes nothing."""
    import json

    from samebits.bench.report import RowLog

    path = tmp_path / "rows.json"
    log = RowLog(path, device="cpu")
    assert not path.exists()
    log.add({"arm": "a", "us": 1.5})
    assert json.loads(path.read_text()) == {"device": "cpu", "rows": [{"arm": "a", "us": 1.5}]}
    log.add({"arm": "b", "error": "x"})
    assert [r["arm"] for r in json.loads(path.read_text())["rows"]] == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]
    quiet = RowLog(None, device="cpu")
    quiet.add({"arm": "a"})
    assert quiet.rows == [{"arm": "a"}] and sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]


def test_engine_limits_take_the_budget_and_size_the_prefill_phase_by_it():
    """A given budget reaches the engine; the prefill phase at a small budget is longer, so the
    sequences' room (max_model_len) grows with it. Without one the engine keeps its default."""
    default = bench.engine_limits((64,), 1024, 64, None)
    small = bench.engine_limits((64,), 1024, 64, None, max_num_batched_tokens=1024)
    large = bench.engine_limits((64,), 1024, 64, None, max_num_batched_tokens=32768)
    assert "max_num_batched_tokens" not in default
    assert small["max_num_batched_tokens"] == 1024 and large["max_num_batched_tokens"] == 32768
    assert small["max_model_len"] > default["max_model_len"] >= large["max_model_len"]


def test_bench_cli_refuses_a_bad_budget(tmp_path, capsys):
    from samebits.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--dir", str(tmp_path / "ckpt"), "--max-num-batched-tokens", "0"])
    assert exit_.value.code == 2 and "--max-num-batched-tokens" in capsys.readouterr().err
