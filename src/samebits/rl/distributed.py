"""The RL loop as N data-parallel ranks: an FSDP2 trainer and one rollout replica per rank.

Started by `torchrun` (one process per rank; gloo on CPU, NCCL on CUDA). Every rank holds:

- a rollout replica, `samebits.LLM`, with the full model in the rollout dtype;
- its shard of the trainer: the transformers model with fp32 master weights, `fully_shard`
  on every decoder layer and on the root, `MixedPrecisionPolicy(param_dtype=<rollout dtype>,
  reduce_dtype=float32)`, so the forward runs on unsharded bf16 params whose bits are the
  replica's.

One step: the step's prompts (a pure function of seed and step, as in `RLLoop`) are split
into W contiguous, equal slices of whole prompts, so each prompt's n responses (one
advantage group) stay on one rank; sampling seeds are indexed globally, so the rollout of
a sequence does not depend on W. Each rank samples, rewards, recomputes and compares its
own share, then computes the loss on that share; FSDP averages the gradients over ranks
(equal shares: the global mean). Weight sync gathers one parameter at a time
(`DTensor.full_tensor()`, cast to the rollout dtype first) into every replica, digests
that full tensor and checks the replica's digest against it; no rank ever holds a second
full copy of the model. Counters are per rank and summed (see `combine`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from samebits.engine.llm import LLM, tensor_digest
from samebits.requests import SamplingParams
from samebits.rl import fsdp
from samebits.rl.batching import pack_micro_batches
from samebits.rl.config import RLConfig
from samebits.rl.loop import (
    DTYPES,
    _compare,
    _freeze,
    _lap,
    _mean,
    _model_path,
    make_prompts,
    recompute_old,
    update_policy,
)
from samebits.rl.losses import group_advantages
from samebits.rl.rewards import compute_rewards, load_reward

PER_RANK = (  # summed over ranks into the metric of the same name; also kept per rank as rank_<name>
    "rollout_logprobs_mismatch_count",
    "rollout_logprobs_tokens",
    "old_logprobs_mismatch_count",
    "old_logprobs_tokens",
    "digest_mismatch_count",
    "padding_micro_batches",  # dummy forwards that kept the ranks' FSDP collectives in step
)


class DistributedRLLoop:
    """This rank's replica + trainer shard + optimizer; `step()` is collective -> combined metrics."""

    def __init__(self, config: RLConfig):
        self.rank, self.world, device = fsdp.init_process_group(config.device)
        if config.num_prompts % self.world:
            raise ValueError(f"num_prompts ({config.num_prompts}) must be a multiple of the {self.world} ranks")
        self.local_prompts = config.num_prompts // self.world
        self.local_seqs = self.local_prompts * config.n
        if config.mini_batches > self.local_seqs:
            raise ValueError(
                f"mini_batches ({config.mini_batches}) must be <= sequences per rank ({self.local_seqs})"
            )
        if config.share_weights:
            raise ValueError(
                "share_weights: the distributed trainer holds float32 shards, which the engine "
                "cannot share; each rank keeps its replica and syncs it"
            )
        self.config = config = replace(config, device=device)
        self.dtype = DTYPES[config.dtype]
        self.path = _model_path(config)
        self.reward_fn = load_reward(config.reward)
        self.llm = LLM(
            self.path,
            device=device,
            dtype=config.dtype,
            max_num_seqs=self.local_seqs,
            max_model_len=config.max_model_len,
            numerics=config.engine_numerics,
        )
        param_dtype = None if self.dtype == torch.float32 else self.dtype
        self.model = fsdp.load_sharded_trainer(
            self.path, device, param_dtype, config.trainer_experts, config.trainer_attention
        )
        self.trainable = _freeze(self.model, config.freeze_patterns())
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.trainable], lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.step_count = 0
        self.padding_micro_batches = 0  # this step's; see _micro_batches
        all_names = [n for n, _ in self.model.named_parameters(remove_duplicate=False)]
        self.digest_names = list(config.digest_tensors) if config.digest_tensors is not None else all_names
        unknown = sorted(set(self.digest_names) - set(all_names))
        if unknown:
            raise ValueError(f"digest_tensors: unknown parameter names {unknown[:5]}")
        bad = self.sync_and_check(push=False)["bad"]  # the replica starts from the trainer's bits
        if bad:
            raise RuntimeError(f"rank {self.rank}: replica and trainer differ before any step: {bad[:5]}")

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> dict:
        """One RL step on every rank (collective); -> the metrics combined over ranks."""
        cfg, t = self.config, {}
        clock = time.perf_counter()
        outs = self._rollout()
        t["rollout"] = _lap(clock)
        responses = [o.token_ids for o in outs]
        rewards = compute_rewards(cfg.reward, self.reward_fn, [o.prompt_token_ids for o in outs], responses)
        t["reward"] = _lap(clock, t)
        self.padding_micro_batches = 0
        self.llm.sleep()
        try:
            seqs = [o.prompt_token_ids + o.token_ids for o in outs]
            plens = [len(o.prompt_token_ids) for o in outs]
            old = self._recompute(seqs, plens)
            t["recompute"] = _lap(clock, t)
            rollout_cmp = _compare([o.logprobs for o in outs], old)
            adv = group_advantages(torch.tensor(rewards), cfg.n)  # whole groups on this rank
            update = self._update(seqs, plens, old, adv)
            t["update"] = _lap(clock, t)
            sync = self.sync_and_check()
            t["sync"], t["digest"] = sync["time_sync"], sync["time_digest"]
        finally:
            self.llm.wake_up()
        self.step_count += 1
        local = {
            "rollout_logprobs_mismatch_count": rollout_cmp[0],
            "rollout_logprobs_tokens": rollout_cmp[1],
            "old_logprobs_mismatch_count": update.pop("old_mismatches"),
            "old_logprobs_tokens": update.pop("old_tokens"),
            "diff_max": max(rollout_cmp[2], update.pop("old_diff_max")),
            "digest_mismatch_count": len(sync["bad"]),
            "padding_micro_batches": self.padding_micro_batches,
            "replica_digest": sync["replica"],
            "trainer_digest": sync["trainer"],
            "rewards": rewards,
            "lengths": [len(r) for r in responses],
            "times": t | {"step": sum(t.values())},
            **update,
        }
        gathered: list[dict] = [{} for _ in range(self.world)]
        dist.all_gather_object(gathered, local)
        return combine(self.step_count - 1, gathered, len(self.digest_names))

    def _rollout(self):
        cfg = self.config
        prompts = make_prompts(
            self.llm.config.vocab_size, cfg.num_prompts, cfg.prompt_len, cfg.seed, self.step_count
        )
        first = self.rank * self.local_prompts  # this rank's prompts: [first, first + local_prompts)
        base = (cfg.seed << 32) + self.step_count * cfg.num_sequences + first * cfg.n  # global seed index
        params = [
            SamplingParams(
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                min_tokens=cfg.max_tokens if cfg.force_max_length else 0,
                ignore_eos=cfg.force_max_length,
                seed=base + i,
            )
            for i in range(self.local_seqs)
        ]
        grouped = [p for p in prompts[first : first + self.local_prompts] for _ in range(cfg.n)]
        return self.llm.generate(grouped, params, progress=False)

    def _micro_batches(self, indices, lengths) -> list[list[int]]:
        """Packed micro-batches, padded with [] to the largest count over ranks: every FSDP
        forward/backward is collective, so every rank must run the same number of them."""
        micro = pack_micro_batches(indices, lengths, self.config.micro_batch_tokens)
        count = fsdp.all_reduce_max(len(micro), self.config.device)
        self.padding_micro_batches += count - len(micro)
        return micro + [[] for _ in range(count - len(micro))]

    def _forward(self, micro, seqs, plens, with_grad: bool) -> list[torch.Tensor]:
        """token_logprobs of a micro-batch; an empty (padding) one runs a 2-token dummy instead."""
        from samebits import trainer

        chosen = [seqs[i] for i in micro] or [seqs[0][:2]]
        lens = [plens[i] for i in micro] or [1]
        return trainer.token_logprobs(
            self.model, chosen, lens, packed=True, temperature=self.config.temperature, with_grad=with_grad
        )

    def _recompute(self, seqs, plens) -> list[torch.Tensor]:
        return recompute_old(self, seqs, plens)

    def _update(self, seqs, plens, old, adv) -> dict:
        """Each rank steps on its own share; FSDP averages the gradients over ranks (the
        shares are equal, so the local mean is the global one)."""
        return update_policy(self, seqs, plens, old, adv)

    # -- weights ----------------------------------------------------------------------------

    def sync_and_check(self, push: bool = True) -> dict:
        """Gather one parameter at a time (cast to the rollout dtype, then `full_tensor()`),
        copy the trainable ones into this replica (`push`), digest the digested ones.

        -> {"bad": names whose replica digest differs from the gathered tensor's,
            "replica"/"trainer": sha256 over the per-name digests, "time_sync"/"time_digest"}.
        Collective: every rank walks the same names in the same order.
        """
        chosen = {n for n, _ in self.trainable} if push else set()
        digested = set(self.digest_names)
        want: dict[str, str] = {}
        t_sync = t_digest = 0.0
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if name not in chosen and name not in digested:
                continue
            clock = time.perf_counter()
            full = fsdp.full_tensor(p.detach(), self.dtype)  # the only full tensor held at a time
            if name in chosen:
                self.llm.update_weights([(name, full)])
            t_sync += time.perf_counter() - clock
            clock = time.perf_counter()
            if name in digested:
                want[name] = tensor_digest(full)
            t_digest += time.perf_counter() - clock
            del full
        clock = time.perf_counter()
        got = self.llm.weight_digests(self.digest_names)
        bad = [n for n in self.digest_names if got[n] != want[n]]
        t_digest += time.perf_counter() - clock
        return {
            "bad": bad,
            "replica": _digest_of(got, self.digest_names),
            "trainer": _digest_of(want, self.digest_names),
            "time_sync": t_sync,
            "time_digest": t_digest,
        }


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
        "reward_mean": _mean(rewards),
        "reward_std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
        "response_len_mean": _mean(lengths),
        "response_len_min": min(lengths),
        "response_len_max": max(lengths),
        "loss": _mean(r["loss"] for r in ranks),
        "clip_frac": _mean(r["clip_frac"] for r in ranks),
        "grad_norm": ranks[0]["grad_norm"],  # the global norm: equal on every rank
    }
    for key in ranks[0]["times"]:
        m[f"time_{key}_s"] = max(r["times"][key] for r in ranks)
    return m


def passed(rows: list[dict]) -> bool:
    """0 mismatches of each kind on every rank at every step, and every digest equal."""
    keys = ("rollout_logprobs_mismatch_count", "old_logprobs_mismatch_count", "digest_mismatch_count")
    return bool(rows) and all(r[k] == 0 for r in rows for k in keys) and all(r["digests_agree"] for r in rows)


def _digest_of(digests: dict[str, str], names: list[str]) -> str:
    """One sha256 over the per-name digests, in name order (independent of parameter order)."""
    return hashlib.sha256("".join(f"{n}:{digests[n]};" for n in sorted(names)).encode()).hexdigest()


def run(config: RLConfig, log=print) -> list[dict]:
    """`config.steps` steps on every rank of the torchrun job -> the combined rows (every rank).

    Rank 0 logs one line per step and, with `config.out_dir`, writes metrics.jsonl (one
    combined row per step, per-rank counters and digests included). The process group is
    torn down at the end when this call created it.
    """
    from pathlib import Path

    from samebits.rl import report

    owned = not dist.is_initialized()
    try:
        loop = DistributedRLLoop(config)
        out = Path(config.out_dir) if config.out_dir and loop.rank == 0 else None
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
        rows = []
        for _ in range(config.steps):
            row = loop.step()
            rows.append(row)
            if out:
                report.append_jsonl(out / "metrics.jsonl", row)
            if loop.rank == 0:
                log(_summary(row))
        dist.barrier()  # no collective in flight when the group is torn down
        return rows
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _summary(r: dict) -> str:
    return (
        f"step {r['step']}: rollout mismatches per rank {r['rank_rollout_logprobs_mismatch_count']} "
        f"of {r['rank_rollout_logprobs_tokens']} tokens, old {r['rank_old_logprobs_mismatch_count']}, "
        f"digest diffs {r['rank_digest_mismatch_count']}, digests agree {r['digests_agree']}; "
        f"step {r['time_step_s']:.2f}s, sync {r['time_sync_s']:.3f}s, digest {r['time_digest_s']:.3f}s"
    )
