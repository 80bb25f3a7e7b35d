"""The closed RL loop: rollout -> rewards -> recompute -> compare -> update -> sync -> digests.

Engine and trainer are colocated on one device: the engine (`samebits.LLM`) samples,
then sleeps (KV cache released) while the transformers model recomputes the old
log-probs and takes its optimizer steps; the new weights stream into the engine
tensor by tensor (`update_weights`, no staged copy) and the sha256 digests of both
sides are compared. With `share_weights` the engine runs on the trainer's own tensors:
one copy of the model, nothing to stream. A step that raises before the optimizer step
(a failing reward, a bad rollout) changes nothing: no optimizer step, no sync, the step
counter stays.
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch

from samebits.engine.llm import LLM, tensor_digest
from samebits.numerics.batch_invariant import batch_invariant
from samebits.requests import SamplingParams
from samebits.rl.batching import pack_micro_batches, split_mini_batches
from samebits.rl.config import RLConfig
from samebits.rl.losses import LOSSES, group_advantages
from samebits.rl.rewards import compute_rewards, load_reward

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class RLLoop:
    """Engine + trainer + optimizer for one `RLConfig`; `step()` runs one RL step -> metrics."""

    def __init__(self, config: RLConfig):
        from samebits import trainer

        self.config = config
        self.path = _model_path(config)
        self.reward_fn = load_reward(config.reward)
        self.model = trainer.load_hf_model(
            self.path,
            device=config.device,
            dtype=DTYPES[config.dtype],
            experts_implementation=config.trainer_experts,
            attn_implementation=config.trainer_attention,
        )
        shared = self.model.named_parameters(remove_duplicate=False) if config.share_weights else None
        self.llm = LLM(
            self.path,
            weights=shared,
            device=config.device,
            dtype=config.dtype,
            max_num_seqs=config.num_sequences,
            max_model_len=config.max_model_len,
            numerics=config.engine_numerics,
        )
        self.trainable = _freeze(self.model, config.freeze_patterns())
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.trainable],
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )
        self.step_count = 0
        all_names = [n for n, _ in self.model.named_parameters(remove_duplicate=False)]
        self.digest_names = list(config.digest_tensors) if config.digest_tensors is not None else all_names
        unknown = sorted(set(self.digest_names) - set(all_names))
        if unknown:
            raise ValueError(f"digest_tensors: unknown parameter names {unknown[:5]}")

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> dict:
        """One RL step; returns its metrics (see docs/rl.md for each field)."""
        cfg, m, t = self.config, {"step": self.step_count}, {}
        clock = time.perf_counter()
        outs = self._rollout()
        t["rollout"] = _lap(clock)
        responses = [o.token_ids for o in outs]
        rewards = compute_rewards(cfg.reward, self.reward_fn, [o.prompt_token_ids for o in outs], responses)
        t["reward"] = _lap(clock, t)
        self.llm.sleep()
        try:
            seqs = [o.prompt_token_ids + o.token_ids for o in outs]
            plens = [len(o.prompt_token_ids) for o in outs]
            old = self._recompute(seqs, plens)
            t["recompute"] = _lap(clock, t)
            rollout_cmp = _compare([o.logprobs for o in outs], old)
            adv = group_advantages(torch.tensor(rewards), cfg.n)
            update = self._update(seqs, plens, old, adv)
            t["update"] = _lap(clock, t)
            self.sync_weights()
            t["sync"] = _lap(clock, t)
            bad_digests = self.digest_mismatches()
            t["digest"] = _lap(clock, t)
        finally:
            self.llm.wake_up()
        self.step_count += 1
        lengths = [len(r) for r in responses]
        m |= {
            "rollout_logprobs_mismatch_count": rollout_cmp[0],
            "rollout_logprobs_tokens": rollout_cmp[1],
            "old_logprobs_mismatch_count": update.pop("old_mismatches"),
            "old_logprobs_tokens": update.pop("old_tokens"),
            "diff_max": max(rollout_cmp[2], update.pop("old_diff_max")),
            "digest_mismatch_count": len(bad_digests),
            "digests_checked": len(self.digest_names),
            "reward_mean": _mean(rewards),
            "reward_std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
            "response_len_mean": _mean(lengths),
            "response_len_min": min(lengths),
            "response_len_max": max(lengths),
            **update,
        }
        m |= {f"time_{k}_s": v for k, v in t.items()} | {"time_step_s": sum(t.values())}
        return m

    def _rollout(self):
        cfg = self.config
        vocab = self.llm.config.vocab_size
        prompts = make_prompts(vocab, cfg.num_prompts, cfg.prompt_len, cfg.seed, self.step_count)
        base = (cfg.seed << 32) + self.step_count * cfg.num_sequences
        params = [
            SamplingParams(
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                min_tokens=cfg.max_tokens if cfg.force_max_length else 0,
                ignore_eos=cfg.force_max_length,
                seed=base + i,
            )
            for i in range(cfg.num_sequences)
        ]
        grouped = [p for p in prompts for _ in range(cfg.n)]  # n consecutive responses per prompt
        return self.llm.generate(grouped, params, progress=False)

    def _recompute(self, seqs, plens) -> list[torch.Tensor]:
        return recompute_old(self, seqs, plens)

    def _update(self, seqs, plens, old, adv) -> dict:
        return update_policy(self, seqs, plens, old, adv)

    def _micro_batches(self, indices, lengths) -> list[list[int]]:
        return pack_micro_batches(indices, lengths, self.config.micro_batch_tokens)

    def _forward(self, micro, seqs, plens, with_grad: bool) -> list[torch.Tensor]:
        """Packed token_logprobs of one micro-batch."""
        from samebits import trainer

        chosen, lens = [seqs[i] for i in micro], [plens[i] for i in micro]
        return trainer.token_logprobs(
            self.model, chosen, lens, packed=True, temperature=self.config.temperature, with_grad=with_grad
        )

    # -- weights ----------------------------------------------------------------------------

    def sync_weights(self, names: list[str] | None = None) -> None:
        """Stream the trainer's tensors into the engine, one at a time (no staged state dict).
        names=None: the trainable ones (frozen ones cannot have changed). With shared weights
        the engine's parameters are the trainer's: nothing to copy."""
        if self.config.share_weights:
            return
        params = dict(self.model.named_parameters())
        chosen = [n for n, _ in self.trainable] if names is None else names
        self.llm.update_weights((n, params[n].detach()) for n in chosen)

    def digest_mismatches(self) -> list[str]:
        """Names among `digest_names` whose sha256 differs between trainer and engine."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        engine = self.llm.weight_digests(self.digest_names)
        return [n for n in self.digest_names if engine[n] != tensor_digest(params[n])]

    # -- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path) -> Path:
        """Model + optimizer + step + RNG states, in one torch.save file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "config": asdict(self.config),
            "step": self.step_count,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": _rng_state(),
        }
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path)
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a `save_checkpoint` file, push every trainer tensor to the engine, check digests."""
        state = torch.load(path, map_location="cpu", weights_only=False)  # RNG states must stay on CPU
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step"])
        _set_rng_state(state["rng"])
        self.sync_weights([n for n, _ in self.model.named_parameters()])
        bad = self.digest_mismatches()
        if bad:
            raise RuntimeError(f"after resume, engine and trainer digests differ for {bad[:5]}")


def make_prompts(vocab_size: int, num: int, length: int, seed: int, step: int) -> list[list[int]]:
    """Random prompts, a pure function of (seed, step); ids in [2, vocab) (0/1 are bos/eos in tiny)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(2, vocab_size, (num, length), generator=g).tolist()


def _model_path(config: RLConfig) -> Path:
    if config.model is not None:
        return Path(config.model)
    from samebits.model.tiny import tiny_checkpoint_cache

    return tiny_checkpoint_cache(dtype=DTYPES[config.dtype])


def _freeze(model, patterns: tuple[str, ...]) -> list[tuple[str, torch.nn.Parameter]]:
    """requires_grad_(False) on parameters whose name contains a pattern -> the trainable (name, p)."""
    named = list(model.named_parameters())
    for pat in patterns:
        if not any(pat in n for n, _ in named):
            raise ValueError(f"freeze: {pat!r} matches no parameter name (e.g. {named[0][0]!r})")
    trainable = []
    for name, p in named:
        frozen = any(pat in name for pat in patterns)
        p.requires_grad_(not frozen)
        if not frozen:
            trainable.append((name, p))
    if not trainable:
        raise ValueError(f"freeze: {patterns} freezes every parameter; nothing would train")
    return trainable


def _compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[int, int, float]:
    """(tokens whose float32 bits differ, tokens compared, max |diff|); a length gap counts as mismatches."""
    mism, total, diff = 0, 0, 0.0
    for a, b in zip(got, want, strict=True):
        a, b = a.detach().float().cpu(), b.detach().float().cpu()
        n = min(a.numel(), b.numel())
        mism += int((a[:n] != b[:n]).sum()) + abs(a.numel() - b.numel())
        total += max(a.numel(), b.numel())
        if n:
            diff = max(diff, float((a[:n] - b[:n]).abs().max()))
    return mism, total, diff


def _kernels(choice: str):
    """RLConfig's recompute_kernels / update_kernels -> the context the forward runs in."""
    return batch_invariant if choice == "batch_invariant" else nullcontext


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _lap(start: float, laps: dict | None = None) -> float:
    return time.perf_counter() - start - (sum(laps.values()) if laps else 0.0)


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def recompute_old(loop, seqs, plens) -> list[torch.Tensor]:
    """Old log-probs: no grad, under batch_invariant() (unless `recompute_kernels` is "stock"),
    in `loop._micro_batches` packed forwards.

    Shared by `RLLoop` and `DistributedRLLoop`: `loop` gives `model`, `_micro_batches` and
    `_forward` (an empty micro-batch is the distributed loop's padding: its output is dropped).
    """
    loop.model.eval()
    out: list[torch.Tensor | None] = [None] * len(seqs)
    with _kernels(loop.config.recompute_kernels)():
        for micro in loop._micro_batches(range(len(seqs)), [len(s) for s in seqs]):
            lps = loop._forward(micro, seqs, plens, False)
            for i, lp in zip(micro, lps[: len(micro)], strict=True):
                out[i] = lp
    return out  # type: ignore[return-value]


def update_policy(loop, seqs, plens, old, adv) -> dict:
    """`mini_batches` optimizer steps; the first one's forward is compared with `old` bit for bit.

    An empty micro-batch (distributed padding) backpropagates a zero loss so every rank runs
    the same collectives. `loop` gives `model`, `config`, `trainable`, `optimizer`,
    `_micro_batches` and `_forward`.
    """
    cfg = loop.config
    loss_fn = LOSSES[cfg.algorithm]
    lengths = [len(s) for s in seqs]
    params = [p for _, p in loop.trainable]
    loop.model.train()
    losses, clips, norms = [], [], []
    old_cmp = [0, 0, 0.0]
    kernels = _kernels(cfg.update_kernels)
    for k, mini in enumerate(split_mini_batches(len(seqs), cfg.mini_batches)):
        for micro in loop._micro_batches(mini, lengths):
            with kernels():
                new = loop._forward(micro, seqs, plens, True)
            if not micro:
                (0.0 * new[0].sum()).backward()
                continue
            if k == 0:  # before any optimizer step: must equal the recompute bit for bit
                mism, total, diff = _compare([lp.detach() for lp in new], [old[i] for i in micro])
                old_cmp = [old_cmp[0] + mism, old_cmp[1] + total, max(old_cmp[2], diff)]
            seq_loss, clip = loss_fn(new, [old[i] for i in micro], adv[micro], cfg.clip_eps)
            (seq_loss.sum() / len(mini)).backward()  # mini-batch loss: mean over its sequences
            losses += seq_loss.detach().tolist()
            clips += clip.tolist()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))  # DTensor under FSDP
        loop.optimizer.step()
        loop.optimizer.zero_grad(set_to_none=True)
    loop.model.eval()
    return {
        "old_mismatches": old_cmp[0],
        "old_tokens": old_cmp[1],
        "old_diff_max": old_cmp[2],
        "loss": _mean(losses),
        "clip_frac": _mean(clips),
        "grad_norm": _mean(norms),
    }
