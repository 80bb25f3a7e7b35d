"""The numerics profile: one frozen choice, made at engine construction.

- `EXACT` (the default): every GEMM and reduction under `batch_invariant()`,
  samebits' batch-invariant experts and attention. Log-probs are bitwise what
  the trainer's transformers model recomputes (with samebits' experts and
  attention registered).
- `FAST`: the same model with the stock fastest kernels regardless of HF bits:
  cuBLAS GEMMs, `torch._grouped_mm` experts, no fixed-order reductions
  (the fused norm and rotary kernels are used in both profiles). Its
  log-probs depend on the batch. It is the baseline that prices exactness, and a
  mode for evaluation rollouts where nobody trains on the log-probs.

The attention kernel is the same in both (it is batch invariant and is not what
bounds the step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from samebits.kernels.experts import experts, experts_stock
from samebits.numerics.batch_invariant import batch_invariant
from samebits.numerics.ops import fused_anyway


@dataclass(frozen=True)
class Profile:
    name: str
    batch_invariant: bool  # run the step under batch_invariant()
    experts: Callable  # (hidden [T, H], index, weights [T, K], gate_up, down) -> [T, H]

    def context(self) -> contextlib.AbstractContextManager:
        return batch_invariant() if self.batch_invariant else fused_anyway()


EXACT = Profile("exact", batch_invariant=True, experts=experts)
FAST = Profile("fast", batch_invariant=False, experts=experts_stock)
PROFILES = {p.name: p for p in (EXACT, FAST)}
