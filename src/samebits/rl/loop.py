"""The closed RL loop: rollout -> rewards -> recompute -> compare -> update -> sync -> digests.

Engine and trainer are colocated: the engine (`samebits.LLM`) samples, then sleeps (KV
cache released) while the transformers model recomputes the old log-probs and takes its
optimizer steps; the new weights stream into the engine and the digests of both sides
are compared (`digest_kind`: a checksum on the device by default, or sha256). With
`share_weights` the engine runs on the trainer's own tensors: one copy of the model,
nothing to stream. A step that raises before the optimizer step (a failing reward, a
bad rollout) changes nothing: no optimizer step, no sync, the step counter stays.

One loop for one process and for N torchrun ranks: what differs (local slice,
micro-batch padding, weight push, combine) is the `parallel` strategy
(`samebits.rl.parallel`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from samebits.engine.llm import LLM
from samebits.requests import SamplingParams
from samebits.rl import checkpoint, train
from samebits.rl.batching import pack_micro_batches
from samebits.rl.config import RLConfig
from samebits.rl.losses import group_advantages
from samebits.rl.parallel import Local, digest_of
from samebits.rl.rewards import compute_rewards, load_reward

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class RLLoop:
    """Engine + trainer + optimizer for one `RLConfig`; `step()` runs one RL step -> metrics.

    parallel: `Local()` (default) or `DataParallel()` (one torchrun rank; `step` is then
    collective and returns the row combined over ranks)."""

    def __init__(self, config: RLConfig, parallel: Local | None = None):
        self.parallel = parallel = parallel or Local()
        self.config = config = parallel.setup(config)
        self.rank, self.world = parallel.rank, parallel.world
        self.dtype = DTYPES[config.dtype]
        self.path = model_path(config)
        self.reward_fn = load_reward(config.reward)
        self.model = parallel.load_trainer(self.path, config, self.dtype)
        first, count = parallel.local_slice(config.num_prompts)
        self.local_prompts = range(first, first + count)
        shared = self.model.named_parameters(remove_duplicate=False) if config.share_weights else None
        if config.server is not None:  # the engine in another process, over HTTP (rl/remote.py)
            from samebits.rl.remote import RemoteEngine

            self.llm = RemoteEngine(config.server, self.path, config)
        else:
            self.llm = LLM(
                self.path,
                weights=shared,
                device=config.device,
                dtype=config.dtype,
                max_num_seqs=count * config.n,
                max_model_len=config.max_model_len,
                numerics=config.engine_numerics,
                logprob_formula=config.logprob_formula,
            )
        self.trainable = train.freeze(self.model, config.freeze_patterns())
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.trainable], lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.step_count = 0
        self.padding_micro_batches = 0  # this step's; see micro_batches
        all_names = [n for n, _ in self.model.named_parameters(remove_duplicate=False)]
        self.digest_names = list(config.digest_tensors) if config.digest_tensors is not None else all_names
        unknown = sorted(set(self.digest_names) - set(all_names))
        if unknown:
            raise ValueError(f"digest_tensors: unknown parameter names {unknown[:5]}")
        if parallel.check_at_start and (bad := self.sync_and_check(push=False)["bad"]):
            raise RuntimeError(f"rank {self.rank}: replica and trainer differ before any step: {bad[:5]}")

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> dict:
        """One RL step; returns its metrics (see docs/rl.md for each field)."""
        cfg, t = self.config, {}
        clock = time.perf_counter()
        outs = self._rollout()
        t["rollout"] = _lap(clock)
        prompts, responses = [o.prompt_token_ids for o in outs], [o.token_ids for o in outs]
        rewards = compute_rewards(cfg.reward, self.reward_fn, prompts, responses)  # gets copies
        t["reward"] = _lap(clock, t)
        self.padding_micro_batches = 0
        self.llm.sleep()
        try:
            seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
            plens = [len(p) for p in prompts]
            old = self._recompute(seqs, plens)
            t["recompute"] = _lap(clock, t)
            rollout_cmp = train.compare([o.logprobs for o in outs], old)
            adv = group_advantages(torch.tensor(rewards), cfg.n)  # whole groups in this slice
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
            "advantage_abs_max": float(adv.abs().max()) if adv.numel() else 0.0,
            "lengths": [len(r) for r in responses],
            "times": t | {"step": sum(t.values())},
            **update,
        }
        return self.parallel.combine(self.step_count - 1, local, len(self.digest_names))

    def _rollout(self):
        cfg, mine = self.config, self.local_prompts
        prompts = make_prompts(
            self.llm.config.vocab_size, cfg.num_prompts, cfg.prompt_len, cfg.seed, self.step_count
        )
        base = (cfg.seed << 32) + self.step_count * cfg.num_sequences + mine.start * cfg.n  # global seed index
        params = [
            SamplingParams(
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                min_tokens=cfg.max_tokens if cfg.force_max_length else 0,
                ignore_eos=cfg.force_max_length,
                seed=base + i,
            )
            for i in range(len(mine) * cfg.n)
        ]
        grouped = [prompts[p] for p in mine for _ in range(cfg.n)]  # n consecutive responses per prompt
        return self.llm.generate(grouped, params, progress=False)

    def _recompute(self, seqs, plens) -> list[torch.Tensor]:
        return train.recompute_old(self, seqs, plens)

    def _update(self, seqs, plens, old, adv) -> dict:
        return train.update_policy(self, seqs, plens, old, adv)

    def micro_batches(self, indices, lengths) -> list[list[int]]:
        """Packed micro-batches of at most `micro_batch_tokens`, padded by the strategy."""
        micro = pack_micro_batches(indices, lengths, self.config.micro_batch_tokens)
        padded = self.parallel.pad(micro)
        self.padding_micro_batches += len(padded) - len(micro)
        return padded

    def forward(self, micro, seqs, plens, with_grad: bool) -> list[torch.Tensor]:
        """Packed token_logprobs of one micro-batch; an empty (padding) one runs a 2-token dummy."""
        from samebits import trainer

        chosen = [seqs[i] for i in micro] or [seqs[0][:2]]
        lens = [plens[i] for i in micro] or [1]
        return trainer.token_logprobs(
            self.model,
            chosen,
            lens,
            packed=True,
            temperature=self.config.temperature,
            with_grad=with_grad,
            logprob_formula=self.config.logprob_formula,
        )

    # -- weights ----------------------------------------------------------------------------

    def sync_and_check(self, push: bool = True, names: list[str] | None = None) -> dict:
        """Push the trainer's tensors into the engine (`push`: `names`, default the trainable
        ones; nothing with shared weights), then compare the digests of `digest_names`.

        -> {"bad": names whose engine digest (`config.digest_kind`) differs from the trainer's,
            "replica"/"trainer": sha256 over the per-name digests, "time_sync"/"time_digest"}."""
        pushed = [] if not push or self.config.share_weights else names or [n for n, _ in self.trainable]
        kind = self.config.digest_kind  # both sides compute the same kind
        want, t_sync, t_digest = self.parallel.push_weights(
            self.llm, self.model, pushed, self.digest_names, self.dtype, kind=kind
        )
        clock = time.perf_counter()
        got = self.llm.weight_digests(self.digest_names, kind=kind)
        bad = [n for n in self.digest_names if got[n] != want[n]]
        return {
            "bad": bad,
            "replica": digest_of(got, self.digest_names),
            "trainer": digest_of(want, self.digest_names),
            "time_sync": t_sync,
            "time_digest": t_digest + time.perf_counter() - clock,
        }

    def sync_weights(self, names: list[str] | None = None) -> None:
        """Stream the trainer's tensors (`names`, default the trainable ones) into the engine."""
        if not self.config.share_weights:
            names = names or [n for n, _ in self.trainable]
            self.parallel.push_weights(
                self.llm, self.model, names, [], self.dtype, kind=self.config.digest_kind
            )

    def digest_mismatches(self) -> list[str]:
        """Names among `digest_names` whose digest differs between trainer and engine."""
        return self.sync_and_check(push=False)["bad"]

    def close(self) -> None:
        """Stop what the loop started (a spawned server, the weight-update group)."""
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()

    # -- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path) -> Path:
        """Model + optimizer + step + RNG states + config in one file, written atomically."""
        self._check_checkpoints()
        return checkpoint.save(path, self.config, self.step_count, self.model, self.optimizer)

    def load_checkpoint(self, path: str | Path, allow_changes: tuple[str, ...] = ()) -> None:
        """Restore a `save_checkpoint` file (loaded as plain data: no code runs; a changed
        config is refused unless allowed), push every tensor to the engine, check digests."""
        self._check_checkpoints()
        state = checkpoint.load(path)
        checkpoint.check_config(state["config"], self.config, allow_changes)
        self.restore(state)

    def restore(self, state: dict) -> None:
        """Apply a loaded checkpoint state (`checkpoint.load`)."""
        checkpoint.apply(state, self.model, self.optimizer)
        self.step_count = int(state["step"])
        self.sync_weights([n for n, _ in self.model.named_parameters()])
        if bad := self.digest_mismatches():
            raise RuntimeError(f"after resume, engine and trainer digests differ for {bad[:5]}")

    def _check_checkpoints(self) -> None:
        if not self.parallel.supports_checkpoints:
            raise ValueError("checkpoints are not supported with --distributed yet (sharded optimizer state)")


def make_prompts(vocab_size: int, num: int, length: int, seed: int, step: int) -> list[list[int]]:
    """Random prompts, a pure function of (seed, step); ids in [2, vocab) (0/1 are bos/eos in tiny)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(2, vocab_size, (num, length), generator=g).tolist()


def model_path(config: RLConfig) -> Path:
    """The checkpoint directory: `config.model`, or the built-in tiny model's cache folder."""
    if config.model is not None:
        return Path(config.model)
    from samebits.model.qwen3_moe.tiny import tiny_checkpoint_cache

    return tiny_checkpoint_cache(dtype=DTYPES[config.dtype])


def _lap(start: float, laps: dict | None = None) -> float:
    return time.perf_counter() - start - (sum(laps.values()) if laps else 0.0)
