"""Activation checkpointing with samebits' numerics: the recompute runs what the forward ran.

torch's non-reentrant checkpoint (transformers' default for `activation_checkpointing_enable()`,
`gradient_checkpointing_enable()` before 5.23)
recomputes a layer's forward during backward, on autograd's thread and outside the caller's
`batch_invariant()`, and checks that it saves tensors of the same shapes. samebits' swapped
modules (`trainer/forwards.py`, `trainer/attention_forward.py`) choose their path by that
context, so a recompute outside it takes transformers' own forward, saves other tensors, and
torch refuses the backward ("recomputed tensors have different metadata"); a stock forward
recomputed would also not be the forward that ran. `checkpoint_context` is the checkpoint's
`context_fn` that re-enters, around the recompute, the numerics the forward had: its
`batch_invariant()` depth and its profile.

    model.activation_checkpointing_enable(  # gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)
        activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": trainer.checkpoint_context}
    )

Reentrant checkpointing takes no `context_fn`: its recompute runs transformers' path and its
gradients are not those of the forward that ran. It is not supported.
"""

from __future__ import annotations

import contextlib

from samebits.numerics import scope
from samebits.numerics.batch_invariant import batch_invariant


@contextlib.contextmanager
def _as_at_forward(depth: int, profile: str):
    scope.push_profile(profile)
    try:
        with batch_invariant() if depth else contextlib.nullcontext():
            yield
    finally:
        scope.pop_profile()


class _Recompute:
    """The forward's numerics around each recompute: checkpoint enters the one object its
    `context_fn` returned every time it recomputes (a second backward through a retained graph
    recomputes again), so each entry opens a fresh context."""

    def __init__(self, depth: int, profile: str):
        self.depth, self.profile = depth, profile
        self._open: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(_as_at_forward(self.depth, self.profile))
        self._open.append(stack)

    def __exit__(self, *exc) -> bool:
        return bool(self._open.pop().__exit__(*exc))


def checkpoint_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`context_fn` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: called at
    the forward -> (nothing around the forward, the forward's numerics around its recomputes)."""
    return contextlib.nullcontext(), _Recompute(scope.invariant_depth(), scope.profile_name())
