"""`EngineConfig`: the engine's limits and defaults, one validated frozen dataclass.

Each field is checked at construction (ValueError naming the field and the allowed values);
the values computed from it (the KV block count, the per-step token budget, the CUDA graph
sizes) are methods, never written back. `LLM(**engine_kwargs)` builds one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from samebits.engine.cuda_graphs import graph_sizes
from samebits.numerics import logprob_formulas
from samebits.numerics.profile import PROFILES
from samebits.requests import FusedLine
from samebits.requests.sampling_params import logprobs_mode_problem

NUMERICS = tuple(PROFILES)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits; each field is checked at construction."""

    device: str = "cpu"
    dtype: str = "bfloat16"
    max_num_seqs: int = 8
    max_model_len: int = 4096
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    numerics: str = "exact"
    cuda_graphs: bool = True  # decode steps in CUDA graphs (CUDA only; bitwise equal to eager)
    # text prompts share the K/V blocks of a common prefix (the n samples of a request, other
    # requests): vLLM's option; bitwise equal to computing them (engine/block_manager.py)
    enable_prefix_caching: bool = True
    # vLLM's option: the next decode step is scheduled and launched while the device runs
    # this one (engine/core.py); under the exact profile the same tokens and bits. None: on
    # for CUDA, off on the CPU (where the host waits for each step anyway)
    async_scheduling: bool | None = None
    # the trainer line the sampled tokens' log-probs are reported by, for requests that name
    # none (numerics/logprob_formulas.py, docs/logprobs.md): a name, a row function of the
    # logits, or a FusedLine (a row function of the hidden states and the LM head)
    logprob_formula: str | Callable | FusedLine = "log_softmax"
    # vLLM's option: what is reported per token, for requests that name none: raw_logprobs (the
    # formula's line, untruncated), processed_logprobs (the log-prob under the truncated,
    # renormalised distribution the token was drawn from), raw_logits, processed_logits
    # (requests/sampling_params.py LOGPROBS_MODES, docs/logprobs.md)
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.numerics not in NUMERICS:
            raise ValueError(
                f"numerics must be one of {NUMERICS}, got {self.numerics!r} "
                "('exact': bitwise equal to the trainer; 'fast': stock kernels, batch-dependent)"
            )
        for name in ("max_num_seqs", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("max_num_batched_tokens", "num_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        if self.num_blocks is not None and self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"num_blocks * block_size ({self.num_blocks} * {self.block_size}) must hold one "
                f"sequence of max_model_len ({self.max_model_len}) tokens; raise num_blocks"
            )
        for name in ("cuda_graphs", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be None or a bool, got {self.async_scheduling!r}")
        check_device(self.device)
        problem = logprob_formulas.check(self.logprob_formula)
        problem = problem or logprobs_mode_problem(self.logprobs_mode, self.logprob_formula)
        if problem is not None:
            raise ValueError(problem)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def graph_sizes(self) -> tuple[int, ...]:
        """Batch sizes whose decode steps run as CUDA graphs (none on the CPU)."""
        if not self.cuda_graphs or torch.device(self.device).type != "cuda":
            return ()
        return graph_sizes(self.max_num_seqs)

    def resolved_async_scheduling(self) -> bool:
        if self.async_scheduling is None:
            return torch.device(self.device).type == "cuda"
        return self.async_scheduling

    def resolved_num_blocks(self) -> int:
        per_seq = -(-self.max_model_len // self.block_size)
        return self.num_blocks or self.max_num_seqs * per_seq

    def resolved_batched_tokens(self) -> int:
        """The per-step token budget; by default at least 8192 on CUDA (measured on the H200 at
        the Qwen3-30B-A3B shape, 64 x 1024-token prompts: 19.2k prefill tok/s at 2048, 28.7k at
        4096, 36.4k at 8192, 39.5k at 16384; docs/performance.md), 2048 on the CPU."""
        floor = 8192 if torch.device(self.device).type == "cuda" else 2048
        return self.max_num_batched_tokens or max(self.max_model_len, floor)


def check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device") from e
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ValueError(f"device {device!r} is not supported: use 'cpu' or 'cuda'")
    from samebits.numerics.registry import triton_available

    if not triton_available():
        raise ValueError(f"device {device!r} needs CUDA and Triton, which this machine lacks")
    major, _ = torch.cuda.get_device_capability(dev)
    if major < 8:
        raise ValueError(f"device {device!r} is sm_{major}x; samebits' Triton kernels need sm_80 or newer")
