"""`samebits rl --distributed`: the RL loop as N data-parallel torchrun ranks.

Started by `torchrun` (one process per rank; gloo on CPU, NCCL on CUDA). Every rank holds:

- a rollout replica, `samebits.LLM`, with the full model in the rollout dtype;
- its shard of the trainer: the transformers model with fp32 master weights, `fully_shard`
  on every decoder layer and on the root, `MixedPrecisionPolicy(param_dtype=<rollout dtype>,
  reduce_dtype=float32)`, so the forward runs on unsharded bf16 params whose bits are the
  replica's.

The step is `RLLoop.step` under the `DataParallel` strategy (`samebits.rl.parallel`): the
step's prompts are split into W contiguous, equal slices of whole prompts, so each
prompt's n responses (one advantage group) stay on one rank; sampling seeds are indexed
globally, so the rollout of a sequence does not depend on W. FSDP averages the gradients
over ranks. Weight sync gathers one parameter at a time into every replica, digests that
full tensor and checks the replica's digest against it. Counters are per rank and summed
(see `combine`).
"""

from __future__ import annotations

import torch.distributed as dist

from samebits.rl.config import RLConfig
from samebits.rl.loop import RLLoop
from samebits.rl.parallel import DataParallel, combine, digest_of, passed

__all__ = ["DistributedRLLoop", "combine", "digest_of", "passed", "run"]


class DistributedRLLoop(RLLoop):
    """This rank's replica + trainer shard + optimizer; `step()` is collective -> combined metrics."""

    def __init__(self, config: RLConfig):
        super().__init__(config, DataParallel())


def run(config: RLConfig, log=print, overwrite: bool = False) -> list[dict]:
    """`config.steps` steps on every rank of the torchrun job -> the combined rows (every rank).

    Rank 0 logs one line per step and, with `config.out_dir`, writes metrics.jsonl (one
    combined row per step, per-rank counters and digests included). The process group is
    torn down at the end when this call created it.
    """
    from samebits.rl.driver import run as run_loop

    owned = not dist.is_initialized()
    try:
        rows = run_loop(
            config,
            live=False,
            checkpoint_every=0,
            log=log,
            overwrite=overwrite,
            parallel=DataParallel(),
            step_log=summary,
        )
        dist.barrier()  # no collective in flight when the group is torn down
        return rows
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def summary(r: dict) -> str:
    """One log line per step: every rank's counters."""
    return (
        f"step {r['step']}: rollout mismatches per rank {r['rank_rollout_logprobs_mismatch_count']} "
        f"of {r['rank_rollout_logprobs_tokens']} tokens, old {r['rank_old_logprobs_mismatch_count']}, "
        f"digest diffs {r['rank_digest_mismatch_count']}, digests agree {r['digests_agree']}; "
        f"step {r['time_step_s']:.2f}s, sync {r['time_sync_s']:.3f}s, digest {r['time_digest_s']:.3f}s"
    )
