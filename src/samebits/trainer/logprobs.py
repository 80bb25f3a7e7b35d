"""The trainer's side: load the transformers model and recompute token log-probs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.weak import WeakTensorKeyDictionary
from transformers import AutoModelForCausalLM

from samebits.model.families import family_for
from samebits.numerics import logprob_formulas
from samebits.numerics.ops import rotary_inv_freq
from samebits.trainer import line
from samebits.trainer.checks import from_pretrained_checked
from samebits.trainer.drift import check_transformers_numerics
from samebits.trainer.hub_kernels import refuse_hub_kernels
from samebits.trainer.registration import remember_packings
from samebits.trainer.swap import use_samebits_forwards


class RotaryMismatchError(RuntimeError):
    """The model's rotary `inv_freq` is not the CPU fp32 formula's."""


def _rotary_modules(model):
    return [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "config")]


def _expected_inv_freq(rotary) -> torch.Tensor:
    cfg = rotary.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    return rotary_inv_freq(head_dim, theta)


def reset_rotary_inv_freq(model) -> None:
    """Set every rotary `inv_freq` to the CPU fp32 formula (moved to its device)."""
    for rotary in _rotary_modules(model):
        expected = _expected_inv_freq(rotary).to(rotary.inv_freq.device)
        rotary.inv_freq.copy_(expected)
        if hasattr(rotary, "original_inv_freq"):
            rotary.original_inv_freq.copy_(expected)


# inv_freq tensor -> (its version, its data pointer) when it last passed. `token_logprobs` checks
# on every call (each micro-batch of an RL update), and on CUDA each check copies to the host: a
# device sync that stops the host running ahead of the GPU. A tensor written since (in place: a
# new version), given other storage (`.data =`) or a new one (`model.to`, a reload) is checked
# again; a write through `.data` (which bumps no version) after a pass is not seen.
_PASSED = WeakTensorKeyDictionary()


def check_rotary_inv_freq(model) -> None:
    """Raise `RotaryMismatchError` unless every rotary `inv_freq` equals the CPU formula."""
    for rotary in _rotary_modules(model):
        seen = (rotary.inv_freq._version, rotary.inv_freq.data_ptr())
        if _PASSED.get(rotary.inv_freq) == seen:
            continue
        if rotary.inv_freq.dtype != torch.float32:
            raise RotaryMismatchError(
                f"rotary inv_freq is {rotary.inv_freq.dtype}, expected float32; "
                "call samebits.trainer.reset_rotary_inv_freq(model) after casting the model"
            )
        if not torch.equal(rotary.inv_freq.cpu(), _expected_inv_freq(rotary)):
            raise RotaryMismatchError(
                "the model's rotary inv_freq differs from the CPU fp32 formula (it was probably "
                "computed on the GPU); call samebits.trainer.reset_rotary_inv_freq(model)"
            )
        _PASSED[rotary.inv_freq] = seen


def load_hf_model(
    path, device="cpu", dtype: torch.dtype = torch.bfloat16, *, samebits_forwards: bool = True, **kwargs
):
    """A transformers model with samebits experts and attention, rotary checked. `path`: a
    checkpoint directory or a hub id in the local HF cache; a checkpoint the engine would
    refuse is refused here too (`trainer/checks.py`), hub kernels are kept out
    (`trainer/hub_kernels.py`) and a transformers that no longer computes the engine's bits
    is refused by name (`trainer/drift.py`). `samebits_forwards`: its linears and
    RMSNorms run samebits' forwards (same bits, less host time: `trainer/forwards.py`)."""
    kwargs.setdefault("experts_implementation", "samebits")
    kwargs.setdefault("attn_implementation", "samebits")
    if torch.device(device).type == "cuda":  # straight to the GPU: no full copy in host memory
        kwargs.setdefault("device_map", str(device))
    refuse_hub_kernels(kwargs)
    model = from_pretrained_checked(AutoModelForCausalLM, path, dtype=dtype, **kwargs).to(device)
    reset_rotary_inv_freq(model)
    check_transformers_numerics(model)  # this transformers computes the engine's bits (trainer/drift.py)
    if samebits_forwards:
        use_samebits_forwards(model, check=False)
    model.eval()
    return model


def token_logprobs(
    model,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    packed: bool = False,
    temperature: float = 1.0,
    with_grad: bool = False,
    multimodal: Sequence | None = None,
    logprob_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    logprob_formula: str = "log_softmax",
) -> list[torch.Tensor]:
    """Teacher-forced log-prob of every response token, one float32 tensor per sequence.

    sequences[i] is prompt + response; its first prompt_lens[i] tokens are the
    prompt. packed=False runs one forward per sequence; packed=True runs all of
    them in one forward of shape [1, sum(len)] with positions restarting at 0
    per sequence. Log-probs are `torch.log_softmax(logits.float() / T, dim=-1)` at the
    next token, T the Python float `temperature` (0 means 1, as for greedy rollouts): the
    line trainers write, which the engine's reported log-prob equals bit for bit
    (`samebits.numerics.ops.reported_logprobs`).

    For the Qwen3-Omni thinker (`trainer.load_hf_thinker`), multimodal[i] is sequence i's
    prompt as given to `LLM.generate` (a MultimodalPrompt or processor dict; None: text only).

    `logprob_fn` replaces the line (logits rows [n, V] -> log-probs [n, V]); for controls and
    for checking another formula against the engine (docs/design.md lists which are exact).
    `logprob_formula`: the named trainer line instead of the default (a name in
    `LOGPROB_FORMULAS`, `numerics.logprob_formulas`, docs/logprobs.md), the line an engine
    run with the same `logprob_formula` reports.
    """
    if logprob_formula not in logprob_formulas.FORMULAS:
        raise ValueError(
            f"logprob_formula must be one of {logprob_formulas.FORMULAS}, got {logprob_formula!r} "
            "(a row function: pass logprob_fn, or call it on the logits yourself)"
        )
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt_lens")
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        if not 1 <= p <= len(seq):
            raise ValueError(f"sequence {i}: prompt_len {p} must be in [1, {len(seq)}]")
    family = family_for(model.config)  # positions and extra inputs per family (model/family.py)
    prompts = family.trainer_prompts(sequences, prompt_lens, multimodal)
    check_rotary_inv_freq(family.trainer_decoder(model))
    check_transformers_numerics(model)  # once per model; a user's own model too (trainer/drift.py)
    temp = 1.0 if temperature == 0 else float(temperature)
    device = next(model.parameters()).device
    groups = [list(range(len(sequences)))] if packed else [[i] for i in range(len(sequences))]
    out: list[torch.Tensor | None] = [None] * len(sequences)
    with torch.set_grad_enabled(with_grad):
        for group in groups:
            ids = torch.tensor([t for i in group for t in sequences[i]], device=device)
            pos, extra = family.trainer_inputs(
                model, [sequences[i] for i in group], [prompts[i] for i in group]
            )
            pos_on_device = pos.to(device)
            if pos.dim() == 2 and pos.device.type == "cpu":  # its packing read here, not from the device
                remember_packings(pos_on_device, pos)
            logits = model(input_ids=ids[None], position_ids=pos_on_device, use_cache=False, **extra).logits[0]
            offset = 0
            for i in group:
                n, p = len(sequences[i]), prompt_lens[i]
                rows = logits[offset + p - 1 : offset + n - 1]  # [n - p, V]
                targets = ids[offset + p : offset + n]
                if logprob_fn is None and logprob_formula != logprob_formulas.DEFAULT:
                    out[i] = logprob_formulas.token_logprobs(
                        rows, targets, [temp] * len(targets), [logprob_formula] * len(targets)
                    )
                else:  # the trainer's line (reported_logprobs), or the caller's
                    lp = line.trainer_logprobs(rows, temp) if logprob_fn is None else logprob_fn(rows)
                    out[i] = lp.gather(-1, targets[:, None])[:, 0]
                offset += n
    return out  # type: ignore[return-value]
