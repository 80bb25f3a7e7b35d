"""The transformers side: samebits experts/attention registered, teacher-forced log-probs."""

from samebits.trainer.checkpointing import checkpoint_context
from samebits.trainer.drift import TransformersDriftError, check_transformers_numerics
from samebits.trainer.hub_kernels import HubKernelError
from samebits.trainer.logprobs import (
    RotaryMismatchError,
    check_rotary_inv_freq,
    load_hf_model,
    reset_rotary_inv_freq,
    token_logprobs,
)
from samebits.trainer.omni import load_hf_thinker
from samebits.trainer.processed import kept_tokens, processed_logprobs
from samebits.trainer.registration import register
from samebits.trainer.swap import use_samebits_forwards

register()

__all__ = [
    "HubKernelError",
    "RotaryMismatchError",
    "TransformersDriftError",
    "checkpoint_context",
    "check_rotary_inv_freq",
    "check_transformers_numerics",
    "kept_tokens",
    "load_hf_model",
    "load_hf_thinker",
    "processed_logprobs",
    "register",
    "reset_rotary_inv_freq",
    "token_logprobs",
    "use_samebits_forwards",
]
