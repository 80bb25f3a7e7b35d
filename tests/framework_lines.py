"""The frameworks' own log-prob code, called for one id per row: what the engine's
`logprob_formula` lines are compared with (test_logprob_formula_tops.py, test_prompt_logprobs.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from samebits.numerics import logprob_formulas as lf


def _verl_v2(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl 0.9.1 `verl/utils/torch_functional.py` `logprobs_from_logits_v2`, its op order:
    float logits: gather minus a per-row logsumexp; other dtypes: a per-row log_softmax in that
    dtype, gathered (written here: verl does not share this environment)."""
    if logits.dtype in (torch.float32, torch.float64):
        at = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        return at - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    rows = []
    for row, label in zip(logits, labels, strict=True):
        rows.append(F.log_softmax(row, dim=-1).gather(dim=-1, index=label.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def _verl(logits: torch.Tensor, ids: torch.Tensor, t: float) -> torch.Tensor:
    """verl's FSDP engine: logits divided by T rounded to their dtype (skipped at T = 1), then v2."""
    if t != 1.0:
        logits = logits / torch.tensor([t], device=logits.device).clamp(min=1e-8).to(logits.dtype)
    return _verl_v2(logits, ids).float()


def theirs(formula: str, hidden, weight, logits, ids: torch.Tensor, t: float) -> torch.Tensor:
    """The framework's own value of each row's id: ids [n] -> float32 [n]."""
    if formula == "log_softmax":
        return torch.log_softmax(logits.float() / t, dim=-1).gather(-1, ids[:, None])[:, 0]
    if formula == "cross_entropy":
        return -F.cross_entropy(logits.float() / t, ids, reduction="none")
    if formula == "logsumexp":
        z = logits.float() / t
        return z.gather(-1, ids[:, None])[:, 0] - torch.logsumexp(z, -1)
    if formula == "verl":
        return _verl(logits, ids, t)
    pytest.importorskip("trl")
    # TRL's Triton kernels read the ids at stride 1, and TRL passes them contiguous (`labels[mask]`,
    # gathered completion ids): a column of an [n, k] table goes in as TRL's own would
    ids = ids.contiguous()
    if formula == "trl_selective":
        try:
            from trl.trainer.utils import selective_log_softmax
        except ImportError:  # TRL's helper needs pandas and datasets; its CUDA branch is this kernel
            from trl.kernels import selective_log_softmax_and_entropy

            return selective_log_softmax_and_entropy(logits, ids, temperature=t)[0].float()
        return selective_log_softmax(logits, ids, temperature=t).float()
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    return ChunkedLogProbFunction.apply(hidden, weight, None, ids, t, lf.TRL_VOCAB_TILE, None, 1.0, ())[0]
