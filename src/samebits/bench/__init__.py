"""`samebits bench`: what users see of the exact and fast profiles (through `LLM.generate`),
beside what the GPU does, and the stock baselines, on one model in one run.

- `core`: the engine step, transformers `generate`, the trainer; `run` (the CUDA run);
- `generate`: decode, prefill and a rollout timed through `LLM.generate` (any device);
- `report`: the rows, the table, bench.json / bench.csv / bench.png.
The RL step ratio comes from `samebits.rl.arms` (the CLI joins it to the result).
"""

from samebits.bench.core import (
    ARMS,
    QWEN3_30B_A3B,
    copy_bandwidth,
    engine_limits,
    engine_step_ms,
    free_memory,
    measure_engine_arm,
    measure_rollout_arm,
    run,
    step_bytes,
    write_random_checkpoint,
)
from samebits.bench.report import BenchResult, Row, print_table, write_outputs

__all__ = [
    "ARMS",
    "QWEN3_30B_A3B",
    "BenchResult",
    "Row",
    "copy_bandwidth",
    "engine_limits",
    "engine_step_ms",
    "free_memory",
    "measure_engine_arm",
    "measure_rollout_arm",
    "print_table",
    "run",
    "step_bytes",
    "write_outputs",
    "write_random_checkpoint",
]
