"""The trainer's log-prob line, in one place: what `token_logprobs` computes and what the
drift probe (`trainer/drift.py`) holds against the engine's `reported_logprobs`."""

from __future__ import annotations

import torch


def trainer_logprobs(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits rows [n, V] -> float32 log-probs [n, V]: `torch.log_softmax(logits.float() / T)`
    with T a Python float, the line trainers write."""
    return torch.log_softmax(rows.float() / temperature, dim=-1)
