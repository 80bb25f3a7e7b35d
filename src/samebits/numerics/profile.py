"""The numerics profile: one frozen choice of implementations, entered per step.

- `EXACT` (the default): every GEMM and reduction under `batch_invariant()`,
  samebits' batch-invariant experts and attention. Log-probs are bitwise what
  the trainer's transformers model recomputes (with samebits' experts and
  attention registered).
- `FAST`: the same model with the fastest kernels regardless of HF bits:
  cuBLAS GEMMs, stock reductions, samebits' Triton experts (faster than
  `torch._grouped_mm` at every size measured), and
  the fused norm, rotary, router and sampler kernels (fast wherever they run). Its
  log-probs depend on the batch. It is the baseline that prices exactness, and a
  mode for evaluation rollouts where nobody trains on the log-probs.

A profile is not stored in the model: `profile.context()` (entered by the runner
around each step and by `LLM.generate` around each call) selects, for the calling
thread, the implementations the ops dispatch to (`numerics.registry.TABLE`).
The attention kernel is the same in both (it is batch invariant and is not what
bounds the step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from samebits.numerics import scope
from samebits.numerics.batch_invariant import batch_invariant


@dataclass(frozen=True)
class Profile:
    name: str  # a profile column of the registry's TABLE
    batch_invariant: bool  # run the step under batch_invariant()

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Select this profile's implementations in the calling thread (re-entrant)."""
        scope.push_profile(self.name)
        try:
            with batch_invariant() if self.batch_invariant else contextlib.nullcontext():
                yield
        finally:
            scope.pop_profile()


EXACT = Profile("exact", batch_invariant=True)
FAST = Profile("fast", batch_invariant=False)
PROFILES = {p.name: p for p in (EXACT, FAST)}
