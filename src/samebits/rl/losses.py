"""Policy-gradient losses: group-normalised advantages, GRPO (token ratio), GSPO (sequence ratio).

Shapes: B = sequences, L_i = response tokens of sequence i. Log-probs come as one
float32 tensor [L_i] per sequence; `new` carries the grad, `old` is the trainer's
recompute under the weights that sampled the tokens (bitwise the rollout's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(rewards: torch.Tensor, n: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps); groups are n consecutive entries.

    rewards [B] with B = prompts * n -> [B] float32. std is the sample std (n - 1), as in
    GRPO; a group whose rewards are all equal gets advantage 0.
    """
    if rewards.dim() != 1 or rewards.numel() % n:
        raise ValueError(f"rewards must be 1-D with a multiple of n={n} entries, got {tuple(rewards.shape)}")
    groups = rewards.float().view(-1, n)  # [P, n]
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    centred = groups - mean
    return torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred)).reshape(-1)


def _clipped_objective(ratio, adv, eps):
    """min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) and where the clipped term is the min."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps, 1 + eps) * adv
    return torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def grpo_losses(new: Sequence[torch.Tensor], old: Sequence[torch.Tensor], adv: torch.Tensor, eps: float):
    """GRPO: per-token ratio exp(new_t - old_t), clipped per token, averaged over the sequence.

    -> (loss [B], clip fraction [B]): loss_i = -mean_t min(r_t A_i, clip(r_t) A_i).
    """
    losses, fracs = [], []
    for i, (lp, lp_old) in enumerate(zip(new, old, strict=True)):
        _check_pair(i, lp, lp_old)
        objective, was_clipped = _clipped_objective(torch.exp(lp - lp_old), adv[i], eps)  # [L_i]
        losses.append(-objective.mean())
        fracs.append(was_clipped.mean())
    return torch.stack(losses), torch.stack(fracs)


def gspo_losses(new: Sequence[torch.Tensor], old: Sequence[torch.Tensor], adv: torch.Tensor, eps: float):
    """GSPO: one ratio per sequence, s_i = exp(mean_t(new_t - old_t)), clipped per sequence.

    -> (loss [B], clip fraction [B]): loss_i = -min(s_i A_i, clip(s_i) A_i); the fraction is 0 or 1.
    """
    losses, fracs = [], []
    for i, (lp, lp_old) in enumerate(zip(new, old, strict=True)):
        _check_pair(i, lp, lp_old)
        ratio = torch.exp((lp - lp_old).mean())  # []
        objective, was_clipped = _clipped_objective(ratio, adv[i], eps)
        losses.append(-objective)
        fracs.append(was_clipped)
    return torch.stack(losses), torch.stack(fracs)


LOSSES = {"grpo": grpo_losses, "gspo": gspo_losses}


def _check_pair(i: int, lp: torch.Tensor, lp_old: torch.Tensor) -> None:
    if lp.shape != lp_old.shape or lp.dim() != 1 or lp.numel() == 0:
        raise ValueError(
            f"sequence {i}: new and old log-probs must be equal-length non-empty 1-D tensors, "
            f"got {tuple(lp.shape)} and {tuple(lp_old.shape)}"
        )
