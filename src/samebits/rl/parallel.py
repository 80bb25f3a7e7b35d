"""What differs between one process and N data-parallel ranks, as a small strategy object.

`RLLoop` runs the same step under either; the strategy answers four questions:

- **local slice**: which of the step's prompts this process samples and trains on;
- **micro-batch padding**: how many packed forwards this process runs (FSDP forwards are
  collective, so every rank must run the same number);
- **weight push**: how the trainer's tensors reach the engine, and their digests;
- **combine**: how the per-process counters become one metrics row.

`Local` is one process holding the whole trainer. `DataParallel` is one torchrun rank:
an FSDP2 trainer shard (float32 master weights, forward in the rollout dtype) and a
full rollout replica (see docs/distributed.md).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace

import torch

from samebits.engine.digest import tensor_digest
from samebits.rl.config import RLConfig
from samebits.rl.train import mean

PER_RANK = (  # summed over ranks into the metric of the same name; also kept per rank as rank_<name>
    "rollout_logprobs_mismatch_count",
    "rollout_logprobs_tokens",
    "old_logprobs_mismatch_count",
    "old_logprobs_tokens",
    "digest_mismatch_count",
    "padding_micro_batches",  # dummy forwards that kept the ranks' FSDP collectives in step
)


class Local:
    """One process: the whole batch, no padding, one `update_weights` call, one row."""

    rank, world = 0, 1
    check_at_start = False  # the trainer and the engine load the same checkpoint in the same dtype
    supports_checkpoints = True

    def setup(self, config: RLConfig) -> RLConfig:
        return config

    def writes(self) -> bool:
        """Whether this process writes the run's files (known before `setup`)."""
        return True

    def local_slice(self, num_prompts: int) -> tuple[int, int]:
        """-> (first prompt, prompts) of this process."""
        return 0, num_prompts

    def load_trainer(self, path, config: RLConfig, dtype: torch.dtype):
        from samebits import trainer

        return trainer.load_hf_model(
            path,
            device=config.device,
            dtype=dtype,
            experts_implementation=config.trainer_experts,
            attn_implementation=config.trainer_attention,
            samebits_forwards=config.invariant_trainer(),
        )

    def pad(self, micro: list[list[int]]) -> list[list[int]]:
        return micro

    def push_weights(
        self, llm, model, push: list[str], digest: list[str], dtype, *, kind: str
    ) -> tuple[dict, float, float]:
        """Stream `push` into the engine in one call (no staged copy), digest `digest` (digest
        `kind`, `samebits.engine.digest`). -> ({name: trainer digest}, sync s, digest s)."""
        params = dict(model.named_parameters(remove_duplicate=False))
        clock = time.perf_counter()
        if push:
            llm.update_weights((n, params[n].detach()) for n in push)
        t_sync = time.perf_counter() - clock
        want = {n: tensor_digest(params[n], kind) for n in digest}
        return want, t_sync, time.perf_counter() - clock - t_sync

    def combine(self, step: int, local: dict, digests_checked: int) -> dict:
        row = combine(step, [local], digests_checked)
        return {k: v for k, v in row.items() if not k.startswith("rank_")}


class DataParallel(Local):
    """This torchrun rank (gloo on CPU, NCCL on CUDA): an equal slice of whole prompts, so
    each advantage group stays on one rank; sampling seeds are indexed globally, so a
    sequence's rollout does not depend on the world size."""

    check_at_start = True  # the replica must start from the bits of the trainer's float32 shards
    supports_checkpoints = False  # sharded optimizer state: not written yet (docs/distributed.md)

    def writes(self) -> bool:
        return int(os.environ.get("RANK", "0")) == 0  # torchrun's rank: rank 0 writes

    def setup(self, config: RLConfig) -> RLConfig:
        from samebits.rl import fsdp

        self.rank, self.world, device = fsdp.init_process_group(config.device)
        if config.num_prompts % self.world:
            raise ValueError(f"num_prompts ({config.num_prompts}) must be a multiple of the {self.world} ranks")
        self.local_prompts = config.num_prompts // self.world
        if config.mini_batches > self.local_prompts * config.n:
            raise ValueError(
                f"mini_batches ({config.mini_batches}) must be <= sequences per rank "
                f"({self.local_prompts * config.n})"
            )
        if config.share_weights:
            raise ValueError(
                "share_weights: the distributed trainer holds float32 shards, which the engine "
                "cannot share; each rank keeps its replica and syncs it"
            )
        self.device = device
        return replace(config, device=device)

    def local_slice(self, num_prompts: int) -> tuple[int, int]:
        return self.rank * self.local_prompts, self.local_prompts

    def load_trainer(self, path, config: RLConfig, dtype: torch.dtype):
        from samebits.rl import fsdp

        param_dtype = None if dtype == torch.float32 else dtype
        return fsdp.load_sharded_trainer(
            path,
            self.device,
            param_dtype,
            config.trainer_experts,
            config.trainer_attention,
            samebits_forwards=config.invariant_trainer(),
        )

    def pad(self, micro: list[list[int]]) -> list[list[int]]:
        """Padded with [] to the largest count over ranks."""
        from samebits.rl import fsdp

        count = fsdp.all_reduce_max(len(micro), self.device)
        return micro + [[] for _ in range(count - len(micro))]

    def push_weights(
        self, llm, model, push: list[str], digest: list[str], dtype, *, kind: str
    ) -> tuple[dict, float, float]:
        """Gather one parameter at a time (cast to the rollout dtype, then `full_tensor()`),
        copy it into this replica when pushed, digest it when digested: no rank ever holds
        a second full copy of the model. Collective: every rank walks the same names."""
        from samebits.rl import fsdp

        pushed, digested = set(push), set(digest)
        want: dict[str, str] = {}
        t_sync = t_digest = 0.0
        for name, p in model.named_parameters(remove_duplicate=False):
            if name not in pushed and name not in digested:
                continue
            clock = time.perf_counter()
            full = fsdp.full_tensor(p.detach(), dtype)  # the only full tensor held at a time
            if name in pushed:
                llm.update_weights([(name, full)])
            t_sync += time.perf_counter() - clock
            clock = time.perf_counter()
            if name in digested:
                want[name] = tensor_digest(full, kind)
            t_digest += time.perf_counter() - clock
            del full
        return want, t_sync, t_digest

    def combine(self, step: int, local: dict, digests_checked: int) -> dict:
        import torch.distributed as dist

        gathered: list[dict] = [{} for _ in range(self.world)]
        dist.all_gather_object(gathered, local)
        return combine(step, gathered, digests_checked)


def combine(step: int, ranks: list[dict], digests_checked: int) -> dict:
    """One metrics row from every rank's local dict: counters summed (and kept per rank as
    rank_<name>), rewards/lengths over the whole batch, times the slowest rank's."""
    m: dict = {"step": step, "world_size": len(ranks)}
    for key in PER_RANK:
        m[key] = sum(r[key] for r in ranks)
        m[f"rank_{key}"] = [r[key] for r in ranks]
    rewards = [x for r in ranks for x in r["rewards"]]
    lengths = [x for r in ranks for x in r["lengths"]]
    digests = {r["replica_digest"] for r in ranks} | {r["trainer_digest"] for r in ranks}
    m |= {
        "diff_max": max(r["diff_max"] for r in ranks),
        "digests_checked": digests_checked,
        "rank_replica_digest": [r["replica_digest"] for r in ranks],
        "rank_trainer_digest": [r["trainer_digest"] for r in ranks],
        "digests_agree": len(digests) == 1,  # every replica and every rank's gathered tensors
        "reward_mean": mean(rewards),
        "reward_std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
        "advantage_abs_max": max(r["advantage_abs_max"] for r in ranks),  # 0: no group's rewards differ
        "response_len_mean": mean(lengths),
        "response_len_min": min(lengths),
        "response_len_max": max(lengths),
        "loss": mean(r["loss"] for r in ranks),
        "clip_frac": mean(r["clip_frac"] for r in ranks),
        "grad_norm": ranks[0]["grad_norm"],  # the global norm: equal on every rank
    }
    for key in ranks[0]["times"]:
        m[f"time_{key}_s"] = max(r["times"][key] for r in ranks)
    return m


def passed(rows: list[dict]) -> bool:
    """0 mismatches of each kind (on every rank) at every step, and every digest equal."""
    keys = ("rollout_logprobs_mismatch_count", "old_logprobs_mismatch_count", "digest_mismatch_count")
    return bool(rows) and all(r[k] == 0 for r in rows for k in keys) and all(r["digests_agree"] for r in rows)


def digest_of(digests: dict[str, str], names: list[str]) -> str:
    """One sha256 over the per-name digests, in name order (independent of parameter order)."""
    return hashlib.sha256("".join(f"{n}:{digests[n]};" for n in sorted(names)).encode()).hexdigest()
