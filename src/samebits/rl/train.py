"""The trainer's half of an RL step: old log-probs, optimizer steps, bitwise comparison, freezing.

Shared by every parallelism (`samebits.rl.parallel`): the loop passes itself as `loop`,
which gives `model`, `config`, `trainable`, `optimizer`, `micro_batches(indices, lengths)`
and `forward(micro, seqs, plens, with_grad)`. An empty micro-batch is distributed
padding: its forward runs (every FSDP forward is collective) and its output is dropped.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from samebits.numerics.batch_invariant import batch_invariant
from samebits.rl.batching import split_mini_batches
from samebits.rl.losses import LOSSES


def recompute_old(loop, seqs, plens) -> list[torch.Tensor]:
    """Old log-probs [L_i] per sequence: no grad, under batch_invariant() (unless
    `recompute_kernels` is "stock"), in the loop's packed micro-batches."""
    loop.model.eval()
    out: list[torch.Tensor | None] = [None] * len(seqs)
    with kernels(loop.config.recompute_kernels)():
        for micro in loop.micro_batches(range(len(seqs)), [len(s) for s in seqs]):
            lps = loop.forward(micro, seqs, plens, False)
            for i, lp in zip(micro, lps[: len(micro)], strict=True):
                out[i] = lp
    return out  # type: ignore[return-value]


def update_policy(loop, seqs, plens, old, adv) -> dict:
    """`mini_batches` optimizer steps; the first one's forward is compared with `old` bit for bit.

    An empty micro-batch (distributed padding) backpropagates a zero loss so every rank runs
    the same collectives; each rank's loss is the mean over its own share, and FSDP averages
    the gradients over ranks (equal shares: the global mean).
    """
    cfg = loop.config
    loss_fn = LOSSES[cfg.algorithm]
    lengths = [len(s) for s in seqs]
    params = [p for _, p in loop.trainable]
    loop.model.train()
    losses, clips, norms = [], [], []
    old_cmp = [0, 0, 0.0]
    for k, mini in enumerate(split_mini_batches(len(seqs), cfg.mini_batches)):
        for micro in loop.micro_batches(mini, lengths):
            with kernels(cfg.update_kernels)():
                new = loop.forward(micro, seqs, plens, True)
            if not micro:
                (0.0 * new[0].sum()).backward()
                continue
            if k == 0:  # before any optimizer step: must equal the recompute bit for bit
                mism, total, diff = compare([lp.detach() for lp in new], [old[i] for i in micro])
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
        "loss": mean(losses),
        "clip_frac": mean(clips),
        "grad_norm": mean(norms),
    }


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[int, int, float]:
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


def freeze(model, patterns: tuple[str, ...]) -> list[tuple[str, torch.nn.Parameter]]:
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


def kernels(choice: str):
    """RLConfig's recompute_kernels / update_kernels -> the context the forward runs in."""
    return batch_invariant if choice == "batch_invariant" else nullcontext


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0
