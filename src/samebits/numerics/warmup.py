"""Run the CPU's vectorized fp32 math once per process before any result is kept.

Measured on the 2-core CI machine (2026-12-03, `scripts/flake_capture.py`): in about 1% of
fresh processes, the first `cos` call that ATen's vector-math path split across both
OpenMP threads (a [94, 24] fp32 tensor: chunks of 2048 elements) gave 12 of the first
thread's 1128 elements another bf16 rounding than every later call in the process; the
second thread's half and all later calls agreed, and 300 repetitions inside one process
never differed. That points to a first-use effect in the vector-math library's threads, not
to samebits' arithmetic. It made `test_set_numerics_switches_the_profile_through_the_public_api`
fail in about 1 run in 30 and would break the engine-trainer contract for a process whose
first such call is its rollout's or its trainer's.

`warm_cpu_vector_math` calls each vectorized fp32 function the model and the sampler use,
on a tensor long enough for every thread to take chunks, and discards the results. It is
a mitigation of a cause outside samebits, not a proof: the rate is too low to test for.
"""

from __future__ import annotations

import torch

_DONE = False
_FUNCTIONS = (torch.cos, torch.sin, torch.exp, torch.expm1, torch.log, torch.log1p, torch.tanh, torch.sigmoid)


def warm_cpu_vector_math() -> None:
    """Once per process: each function of `_FUNCTIONS` over 64 chunks of 2048 fp32 values."""
    global _DONE
    if _DONE:
        return
    x = torch.linspace(-80.0, 80.0, 64 * 2048)
    with torch.no_grad():
        for f in _FUNCTIONS:
            f(x)
        torch.rsqrt(x.abs() + 1.0)
    _DONE = True
