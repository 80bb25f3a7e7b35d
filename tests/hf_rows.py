"""The trainer's rows at the positions an engine output sampled, for the log-prob formula tests."""

from __future__ import annotations

import torch

from samebits import batch_invariant


def hf_rows(model, out):
    """The HF model's final hidden states and logits at the positions that sampled `out`'s
    tokens, and those tokens: (hidden [n, H], logits [n, V], ids [n])."""
    ids = torch.tensor(out.prompt_token_ids + out.token_ids, device=model.device)
    p = len(out.prompt_token_ids)
    with batch_invariant(), torch.no_grad():
        hidden = model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
        logits = model.lm_head(hidden)
    return hidden[p - 1 : -1], logits[p - 1 : -1], ids[p:]
