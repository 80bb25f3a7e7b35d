"""The RL loop's settings: one frozen dataclass, every field checked at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from samebits.engine.digest import DIGEST_KINDS
from samebits.requests.sampling_params import LOGPROB_FORMULAS

ALGORITHMS = ("gspo", "grpo")
DTYPES = ("bfloat16", "float32")
EXPERTS = ("samebits", "grouped_mm", "eager")
ATTENTION = ("samebits", "sdpa", "eager")
KERNELS = ("batch_invariant", "stock")
ENGINE_NUMERICS = ("exact", "fast")

# short names for common parameter groups (name substrings of HF Qwen3-MoE parameters)
FREEZE_GROUPS = {
    "experts": "mlp.experts",
    "router": "mlp.gate.",
    "attention": "self_attn",
    "embeddings": "embed_tokens",
    "lm_head": "lm_head",
    "norms": "norm.weight",
}


@dataclass(frozen=True)
class RLConfig:
    """One RL run. `model=None` is the built-in tiny model (built once into a cache folder).

    Each step samples `num_prompts` random prompts of `prompt_len` tokens, `n` responses
    each of up to `max_tokens` tokens (exactly `max_tokens` with `force_max_length`), and
    takes `mini_batches` optimizer steps over them; each optimizer step's forward/backward
    runs in micro-batches packed to at most `micro_batch_tokens` tokens.
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "bfloat16"
    algorithm: str = "gspo"
    steps: int = 10  # the toy reward rises within 10 steps; in 5 it depends on the CPU (docs/rl.md)
    num_prompts: int = 4
    prompt_len: int = 8
    n: int = 4
    max_tokens: int = 24
    force_max_length: bool = False
    temperature: float = 1.0
    # the trainer line both sides compute: the engine reports it, the recompute and the update
    # use it (a name in LOGPROB_FORMULAS; numerics/logprob_formulas.py, docs/logprobs.md)
    logprob_formula: str = "log_softmax"
    lr: float = 3e-2  # tuned for the tiny model: the toy reward rises within 5 steps
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    # ratio clip range [1 - eps, 1 + eps]. GSPO's paper uses 3e-4 / 4e-4 at lr ~1e-6; at the
    # tiny model's lr the sequence ratios of later mini-batches move much further than that
    clip_eps: float = 0.2
    mini_batches: int = 4
    micro_batch_tokens: int = 512
    freeze: tuple[str, ...] = ()
    reward: str = "toy"  # "toy", "hash", or "module:function"
    seed: int = 0
    trainer_experts: str = "samebits"  # "grouped_mm": negative control of the rollout comparison
    # "stock": the update forward runs outside batch_invariant() (stock GEMMs and reductions),
    # the negative control of the old-log-prob comparison
    update_kernels: str = "batch_invariant"
    # the stock baseline that prices exactness (benchmarks/rl_step.py): engine_numerics="fast",
    # trainer_experts="grouped_mm", trainer_attention="sdpa", both kernels fields "stock"
    engine_numerics: str = "exact"
    trainer_attention: str = "samebits"
    recompute_kernels: str = "batch_invariant"
    digest_tensors: tuple[str, ...] | None = None  # None: every parameter
    # "fast": a checksum on the tensors' device (no host copy, not cryptographic);
    # "sha256": the raw bytes hashed on the host, one core (minutes for a 30B model)
    digest_kind: str = "fast"
    # the engine's parameters are the trainer's tensors (one copy of the model on the device);
    # the sync then has nothing to copy and the digests compare one memory with itself
    share_weights: bool = False
    # the engine is a `samebits serve` reached over HTTP only (samebits.rl.remote): its URL, or
    # "spawn" to start one on 127.0.0.1 for the run; None: an in-process engine
    server: str | None = None
    # how weights reach a server: "distributed" (the weight-update group: gloo on the CPU, NCCL
    # on CUDA) or "tensor" (CUDA IPC handles; shared memory on the CPU): a server on this GPU
    weight_sync: str = "distributed"
    out_dir: str | None = None

    def invariant_trainer(self) -> bool:
        """Whether any trainer forward runs inside batch_invariant() (then the trainer takes
        samebits' forwards for its linears and norms; the stock baseline keeps transformers')."""
        return "batch_invariant" in (self.update_kernels, self.recompute_kernels)

    def __post_init__(self) -> None:
        _one_of("algorithm", self.algorithm, ALGORITHMS)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("trainer_experts", self.trainer_experts, EXPERTS)
        _one_of("update_kernels", self.update_kernels, KERNELS)
        _one_of("recompute_kernels", self.recompute_kernels, KERNELS)
        _one_of("engine_numerics", self.engine_numerics, ENGINE_NUMERICS)
        _one_of("trainer_attention", self.trainer_attention, ATTENTION)
        _one_of("digest_kind", self.digest_kind, DIGEST_KINDS)
        _one_of("logprob_formula", self.logprob_formula, LOGPROB_FORMULAS)
        for name in ("steps", "num_prompts", "prompt_len", "max_tokens", "mini_batches", "micro_batch_tokens"):
            _int_at_least(name, getattr(self, name), 1)
        _int_at_least("n", self.n, 2)  # a group of one has no spread to normalise by
        _int_at_least("seed", self.seed, 0)
        if self.seed >= 2**30:  # rollout seeds are (seed << 32) + index, and must stay below 2**63
            raise ValueError(f"seed must be an int in [0, 2**30), got {self.seed!r}")
        if self.mini_batches > self.num_prompts * self.n:
            raise ValueError(
                f"mini_batches ({self.mini_batches}) must be <= num_prompts * n "
                f"({self.num_prompts * self.n} sequences per step)"
            )
        _positive_float("temperature", self.temperature)
        _positive_float("max_grad_norm", self.max_grad_norm)
        _float_at_least("lr", self.lr, 0.0)
        _float_at_least("weight_decay", self.weight_decay, 0.0)
        _positive_float("clip_eps", self.clip_eps)
        if len(self.betas) != 2 or not all(_is_float(b) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if isinstance(self.freeze, str) or not all(isinstance(f, str) and f for f in self.freeze):
            raise ValueError(f"freeze must be a tuple of non-empty strings, got {self.freeze!r}")
        if self.digest_tensors is not None and (
            isinstance(self.digest_tensors, str) or not all(isinstance(d, str) for d in self.digest_tensors)
        ):
            raise ValueError(f"digest_tensors must be None or a tuple of names, got {self.digest_tensors!r}")
        if not isinstance(self.share_weights, bool):
            raise ValueError(f"share_weights must be True or False, got {self.share_weights!r}")
        _one_of("weight_sync", self.weight_sync, ("distributed", "tensor"))
        if self.server is not None:
            if not isinstance(self.server, str) or not (
                self.server == "spawn" or self.server.startswith(("http://", "https://"))
            ):
                raise ValueError(f"server must be 'spawn' or an http:// URL, got {self.server!r}")
            if self.share_weights:
                raise ValueError("share_weights needs the engine in this process; it cannot go with server")
            if self.server == "spawn" and self.device.startswith("cuda") and self.weight_sync == "distributed":
                raise ValueError(
                    "server='spawn' puts the server on this GPU, and NCCL cannot put two ranks on one GPU: "
                    "use weight_sync='tensor' (CUDA IPC), or a server URL on other GPUs"
                )
        if self.reward not in ("toy", "hash") and self.reward.count(":") != 1:
            raise ValueError(f"reward must be 'toy', 'hash' or 'module:function', got {self.reward!r}")

    @property
    def num_sequences(self) -> int:
        return self.num_prompts * self.n

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.max_tokens

    def freeze_patterns(self) -> tuple[str, ...]:
        """`freeze` with group names (FREEZE_GROUPS) replaced by their name substrings."""
        return tuple(FREEZE_GROUPS.get(f, f) for f in self.freeze)


def _one_of(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_float(x) -> bool:
    return _is_int(x) or (isinstance(x, float) and math.isfinite(x))


def _int_at_least(name: str, value, low: int) -> None:
    if not _is_int(value) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _positive_float(name: str, value) -> None:
    if not _is_float(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _float_at_least(name: str, value, low: float) -> None:
    if not _is_float(value) or value < low:
        raise ValueError(f"{name} must be a finite number >= {low}, got {value!r}")
