"""The trainers' log-prob lines, each reproduced bit for bit (docs/logprobs.md).

A formula maps a row's logits (the model's dtype), its token and its temperature (a Python
float) to the float32 log-prob that one trainer computes for it. Every formula here is
written from the framework's released code named in its docstring, with samebits' ops: under
`batch_invariant()` each reduction is the fixed-order tree (`numerics.batch_invariant`), so
the engine's value of a row equals the trainer's whatever batch either computed it in.

Rows of one call may each have their own formula and temperature (`token_logprobs`). The
temperature's rounding is part of each line: a division by a Python float (`/ T`: the
device's rule, `registry.temperature_scale`), a multiply by its inverse (`* (1 / T)`, TRL's
fused head), or a division by T rounded to the logits' dtype (verl).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from samebits.numerics.registry import pick
from samebits.requests.sampling_params import LOGPROB_FORMULAS, FusedLine, logprob_formula_problem

Tensor = torch.Tensor
RowFunction = Callable[[Tensor, Tensor, float], Tensor]  # (logits [n, V], ids [n], T) -> [n]

FORMULAS = LOGPROB_FORMULAS  # the names (requests/ holds them, so SamplingParams checks without torch)
check = logprob_formula_problem
DEFAULT = "log_softmax"
# TRL 1.16.0: `trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE`, the vocabulary width of a tile
TRL_VOCAB_TILE = 32768
READ_FROM = {"trl": "1.16.0", "verl": "0.9.1"}  # the releases these lines were read from


def _scalar_scale(x: Tensor, temps: Tensor) -> Tensor:
    """x [N, V] float32 and temps [N] float32 -> `x / T` as aten rounds a Python-float divisor
    on x's device (CPU: divides; CUDA: multiplies by the float32 reciprocal)."""
    return pick("temperature_scale", x.device.type)(x, temps)


def _at(values: Tensor, ids: Tensor) -> Tensor:
    """values [n, V], ids [n, k] -> values at the ids [n, k] (a gather: exact)."""
    return values.gather(-1, ids)


# Every line below takes ids [n, k] (k tokens per row: the sampled one, then its top-k) and
# returns [n, k]. Each is "reduce the row once, then read it at each id", so the value at an id
# is the framework's value for that id whatever other ids share the call.


def log_softmax(logits: Tensor, ids: Tensor, temps: Tensor) -> Tensor:
    """samebits' default, the line `torch.log_softmax(logits.float() / T, -1)` at the token."""
    return _at(torch.log_softmax(_scalar_scale(logits.float(), temps), -1), ids)


def logsumexp(logits: Tensor, ids: Tensor, temps: Tensor) -> Tensor:
    """`z = logits.float() / T; z[id] - torch.logsumexp(z, -1)` (unsloth's fp32 line)."""
    z = _scalar_scale(logits.float(), temps)
    return _at(z, ids) - torch.logsumexp(z, -1, keepdim=True)


def cross_entropy(logits: Tensor, ids: Tensor, temps: Tensor) -> Tensor:
    """`-F.cross_entropy(logits.float() / T, ids, reduction="none")`, called once per column of
    ids as a trainer calls it. aten decomposes it into log_softmax and nll_loss (a gather), so
    its bits are `log_softmax`'s."""
    z = _scalar_scale(logits.float(), temps)
    return torch.stack([-F.cross_entropy(z, col, reduction="none") for col in ids.unbind(1)], 1)


def _selective(scaled: Tensor, ids: Tensor) -> Tensor:
    """The dtype split of TRL's `selective_log_softmax` and verl's `logprobs_from_logits_v2`
    on already scaled logits: fp32/fp64 `gather - logsumexp`, else `log_softmax` in the
    logits' dtype (bf16 result, widened)."""
    if scaled.dtype in (torch.float32, torch.float64):
        return (_at(scaled, ids) - torch.logsumexp(scaled, -1, keepdim=True)).float()
    return _at(F.log_softmax(scaled, -1), ids).float()


def trl_selective(logits: Tensor, ids: Tensor, temps: Tensor) -> Tensor:
    """TRL 1.16.0 `trl.trainer.utils.selective_log_softmax(logits, ids, temperature=T)` off
    Triton: `logits / T` in the logits' dtype (skipped at T = 1), then `_selective`. On CUDA
    with Triton TRL runs its own fused kernel: `trl_selective_cuda`."""
    if logits.device.type == "cuda":
        return _by_temperature(trl_selective_cuda, logits, ids, temps)
    ones = temps == 1.0
    scaled = _scalar_scale(logits.float(), temps).to(logits.dtype)
    scaled = torch.where(ones[:, None], logits, scaled)
    return _selective(scaled, ids)


def verl(logits: Tensor, ids: Tensor, temps: Tensor) -> Tensor:
    """verl 0.9.1, FSDP engine (`workers/engine/fsdp/transformer_impl.py`): `logits /
    temperature.clamp(min=1e-8).to(logits.dtype)`, a division by T rounded to the logits'
    dtype (skipped for a host T of 1), then `utils/torch_functional.logprobs_from_logits`:
    flash-attn's Triton cross-entropy where installed (unless VERL_DISABLE_FLASH_ATTN_CE=1),
    else `logprobs_from_logits_v2` (`_selective`)."""
    t = temps.clamp(min=1e-8).to(logits.dtype)[:, None]
    scaled = torch.where((temps == 1.0)[:, None], logits, logits / t)
    if _flash_ce() is not None and logits.device.type == "cuda":
        return torch.stack([-_flash_ce()(scaled, col)[0].float() for col in ids.unbind(1)], 1)
    return _selective(scaled, ids)


def trl(logits: Tensor, ids: Tensor, temps: Tensor) -> Tensor:
    """TRL 1.16.0 `add_fused_lm_head(model, temperature=T)`: `ChunkedLogProbFunction` over
    tiles of TRL_VOCAB_TILE columns of the bf16 projection (the engine's logits: the same GEMM
    per element under batch_invariant(), `torch.mm(..., out=)` included). Per tile, `z =
    tile.float() * 1.0 * float32(1 / T)` (a multiply by the inverse, rounded from float64),
    folded into a running max and sum of exp; `z[id] - (max + log(sum))`. On the CPU TRL folds
    each tile with torch ops (`_forward_tile`), as here; on CUDA with a Triton program per
    token in 1024-wide blocks: `trl_cuda`."""
    if logits.device.type == "cuda":
        return trl_cuda(logits, ids, temps)
    inv_t = torch.tensor([1 / t for t in temps.double().tolist()], dtype=torch.float32, device=logits.device)
    n, vocab = logits.shape
    running_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
    sum_exp = torch.zeros((n,), dtype=torch.float32, device=logits.device)
    target = torch.zeros(ids.shape, dtype=torch.float32, device=logits.device)  # [n, k]
    for start in range(0, vocab, TRL_VOCAB_TILE):
        end = min(start + TRL_VOCAB_TILE, vocab)
        z = logits[:, start:end].float() * 1.0 * inv_t[:, None]  # [n, w]
        new_max = torch.maximum(running_max, z.amax(-1))
        # a row whose tiles so far are all -inf (masked: processed_logprobs) folds 0, not NaN;
        # any other row's max is finite and is used as is, so TRL's bits are unchanged
        at = torch.where(new_max == float("-inf"), 0.0, new_max)
        rescale = torch.exp(running_max - at)
        sum_exp = sum_exp * rescale + torch.exp(z - at[:, None]).sum(-1)
        running_max = new_max
        local = ids - start
        inside = (local >= 0) & (local < end - start)
        target = torch.where(inside, _at(z, local.clamp(0, end - start - 1)), target)
    return target - (running_max + torch.log(sum_exp))[:, None]


def _by_temperature(fn: RowFunction, logits: Tensor, ids: Tensor, temps: Tensor) -> Tensor:
    """fn(rows, ids [n], T) per distinct temperature T (a Python float) and per column of ids
    [n, k]: for lines whose kernel takes one scalar temperature and one id per row per call
    (TRL's Triton kernels, flash-attn's, a user's row function): k calls, each the framework's
    own for that column."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    values = temps.tolist()
    for t in sorted(set(values)):
        rows = torch.tensor([i for i, v in enumerate(values) if v == t], device=logits.device)
        for j in range(ids.shape[1]):
            out[rows, j] = fn(logits[rows], ids[rows, j], float(t)).float()
    return out


def _trl_module(name: str):
    try:
        import importlib

        return importlib.import_module(name)
    except ImportError as e:
        raise NotImplementedError(
            "logprob_formula on CUDA runs TRL's own Triton kernel, so TRL must be installed "
            "(samebits has no Triton copy of it yet; docs/logprobs.md)"
        ) from e


# A truncated row's masked logits (processed_logprobs) go into TRL's Triton fold as this finite
# value, not -inf: the fold rescales by exp(max - new_max), NaN for a 1024-wide block of -inf
# while its running max is still -inf. Each masked entry then adds exp(z - max) = 0, exactly
# what -inf adds once the max is finite, and what it added before is rescaled by exp(-2^100/T -
# max) = 0 when the first kept entry comes: the fold of the kept entries, in TRL's order.
# 2^100 is exact in bf16, fp16 overflows (its rows are refused below), and 2^100/T stays finite
# in float32 down to T = 1e-8.
TRL_MASKED = -(2.0**100)


def trl_cuda(logits: Tensor, ids: Tensor, temps: Tensor) -> Tensor:
    """`trl` on CUDA: TRL's own per-token fold (`trl.kernels.chunked_logprob._forward_kernel`)
    over the logit tiles, the Triton kernel ChunkedLogProbFunction launches, once per
    temperature and id column. Masked (-inf) logits fold as TRL_MASKED (replaced once a call,
    whatever its temperatures and columns), and an id at -inf reads -inf, as on the CPU."""
    masked = torch.isneginf(logits)
    if not bool(masked.any()):
        return _by_temperature(_trl_fold_cuda, logits, ids, temps)
    if logits.dtype == torch.float16:
        raise ValueError("trl on CUDA takes truncated fp16 rows nowhere: use bf16 or fp32 logits")
    out = _by_temperature(_trl_fold_cuda, logits.masked_fill(masked, TRL_MASKED), ids, temps)
    return out.masked_fill(masked.gather(1, ids), float("-inf"))


def _trl_fold_cuda(logits: Tensor, ids: Tensor, temperature: float) -> Tensor:
    """TRL's Triton fold of rows with no -inf (`trl_cuda` puts TRL_MASKED there): the log-prob
    of ids [n] at one temperature."""
    m = _trl_module("trl.kernels.chunked_logprob")
    n, vocab = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    stats = [torch.full((n,), float("-inf"), **f32)] + [torch.zeros((n,), **f32) for _ in range(4)]
    before, target = torch.full((n,), float("-inf"), **f32), torch.zeros((n,), **f32)
    flags = {f"HAS_{o.upper()}": False for o in m.OPTIONAL_OUTPUTS}
    for start in range(0, vocab, TRL_VOCAB_TILE):
        tile = logits[:, start : min(start + TRL_VOCAB_TILE, vocab)]
        m._forward_kernel[(n,)](
            tile, tile.stride(0), ids, *stats, before, target, start, tile.shape[1],
            1.0, 1.0, 1 / temperature, HAS_SOFTCAP=False, BLOCK_SIZE=m._BLOCK_SIZE, **flags,
        )  # fmt: skip
    return target - (stats[0] + torch.log(stats[1]))


def trl_selective_cuda(logits: Tensor, ids: Tensor, temperature: float) -> Tensor:
    """`trl_selective` on CUDA: TRL's own fused Triton kernel, the branch TRL 1.16.0's
    `selective_log_softmax` takes for the engine's rows (CUDA, bf16/fp16/fp32, 2-D, last dim
    contiguous, int64 ids, no row mask). Called from `trl.kernels`, which needs neither pandas nor
    datasets (`trl.trainer.utils` does); tests/test_logprob_formulas.py checks the two equal where
    all of TRL imports."""
    if ids.dtype != torch.int64 or logits.stride(-1) != 1 or logits.ndim != 2:
        raise ValueError("trl_selective on CUDA takes [n, V] logits with a contiguous last dim and int64 ids")
    fused = _trl_module("trl.kernels").selective_log_softmax_and_entropy
    return fused(logits, ids, temperature=temperature)[0]


def _flash_ce():
    """flash-attn's `cross_entropy_loss` where verl would use it, else None."""
    if os.environ.get("VERL_DISABLE_FLASH_ATTN_CE", "0") == "1":
        return None
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss
    except ImportError:
        return None
    return cross_entropy_loss


Line = Callable[[Tensor, Tensor, Tensor], Tensor]  # (logits [n, V], ids [n] or [n, k], temps [n])


def _ids_of_any_rank(line: Line) -> Line:
    """A line over ids [n, k] that also takes ids [n] (-> [n])."""

    def either(logits: Tensor, ids: Tensor, temps: Tensor) -> Tensor:
        return line(logits, ids[:, None], temps)[:, 0] if ids.ndim == 1 else line(logits, ids, temps)

    either.__name__ = either.__qualname__ = line.__name__
    either.__doc__ = line.__doc__
    return either


LINES: dict[str, Line] = {
    name: _ids_of_any_rank(line)
    for name, line in {
        "log_softmax": log_softmax,
        "trl": trl,
        "trl_selective": trl_selective,
        "verl": verl,
        "logsumexp": logsumexp,
        "cross_entropy": cross_entropy,
    }.items()
}


Head = tuple[Tensor, Tensor]  # (final hidden states [N, H], LM head weight [V, H]): a FusedLine's inputs


def token_logprobs(
    logits: Tensor,
    ids: Tensor,
    temperatures: Sequence[float],
    formulas: Sequence[str | RowFunction | FusedLine],
    head: Head | None = None,
) -> Tensor:
    """logits [N, V] (the model's dtype), ids [N] or [N, k], each row's temperature (a Python
    float; 0, greedy, reads as 1) and formula -> float32 log-probs of ids' shape, each row by its
    own line. With ids [N, k] (a row's sampled token and its top-k ids) the row's line is
    reduced once and read at each id: the value at an id is the line's for that id alone.
    `head`: the rows' hidden states and the LM head, which a `FusedLine` row is computed from
    (the logits are the head's projection of the hidden states)."""
    if ids.ndim == 1:
        return token_logprobs(logits, ids[:, None], temperatures, formulas, head)[:, 0]
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=torch.float32)
    temps = temps.to(logits.device)
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    for formula in dict.fromkeys(formulas):  # each distinct formula once, in order of first use
        rows = torch.tensor([i for i, f in enumerate(formulas) if f == formula], device=logits.device)
        if isinstance(formula, FusedLine):
            out[rows] = _fused_line(formula, head)(logits[rows], ids[rows], temps[rows], rows)
            continue
        line = LINES[formula] if isinstance(formula, str) else _user_line(formula)
        out[rows] = line(logits[rows], ids[rows], temps[rows])
    return out


def _user_line(fn: RowFunction) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    return lambda logits, ids, temps: _by_temperature(fn, logits, ids, temps)


def _fused_line(line: FusedLine, head: Head | None) -> Callable:
    """A FusedLine as a line over the rows `rows` of `head`'s hidden states: fn(hidden rows,
    weight, ids [n], T) per temperature and per column of ids."""
    if head is None:
        raise ValueError(
            f"logprob_formula FusedLine({line.name}) is computed from the hidden states and the LM "
            "head, and this call was given logits only (pass head=(hidden, lm_head_weight))"
        )
    hidden, weight = head

    def fused(logits: Tensor, ids: Tensor, temps: Tensor, rows: Tensor) -> Tensor:
        fn = lambda h, i, t: line.fn(h, weight, i, t)  # noqa: E731 - a row function of the hidden rows
        return _by_temperature(fn, hidden.index_select(0, rows.to(hidden.device)), ids, temps)

    return fused


def check_row_invariant(fn: RowFunction, vocab: int, dtype: torch.dtype, device: str = "cpu") -> None:
    """Refuse a user's row function (`logprob_formula=callable`) unless a batch of rows and
    each row alone give the same bits under batch_invariant(), at two temperatures."""
    from samebits.numerics.batch_invariant import batch_invariant

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, vocab, generator=g) * 4).to(dtype).to(device)
    ids = torch.randint(0, vocab, (5,), generator=g).to(device)
    with batch_invariant():
        for t in (1.0, 0.7):
            whole = fn(logits, ids, t).float()
            alone = torch.cat([fn(logits[i : i + 1], ids[i : i + 1], t).float().reshape(1) for i in range(5)])
            if whole.shape != ids.shape or not torch.equal(whole, alone):
                name = getattr(fn, "__qualname__", repr(fn))
                raise ValueError(
                    f"logprob_formula {name} is not row-invariant: a batch of 5 rows and the rows "
                    f"one at a time differ at temperature {t} under batch_invariant()"
                )


def check_fused_row_invariant(line: FusedLine, weight: Tensor) -> None:
    """Refuse a user's fused line (`logprob_formula=FusedLine(fn)`) unless a batch of 5 rows of
    hidden states and each row alone give the same bits under batch_invariant(), at two
    temperatures, with the engine's own LM head `weight` [V, H] (its dtype and device)."""
    from samebits.numerics.batch_invariant import batch_invariant

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, weight.shape[1], generator=g).to(weight.dtype).to(weight.device)
    ids = torch.randint(0, weight.shape[0], (5,), generator=g).to(weight.device)
    with batch_invariant(), torch.no_grad():
        for t in (1.0, 0.7):
            whole = line.fn(hidden, weight, ids, t).float()
            alone = [line.fn(hidden[i : i + 1], weight, ids[i : i + 1], t).float().reshape(1) for i in range(5)]
            if whole.shape != ids.shape or not torch.equal(whole, torch.cat(alone)):
                raise ValueError(
                    f"logprob_formula FusedLine({line.name}) is not row-invariant: a batch of 5 rows "
                    f"of hidden states and the rows one at a time differ at temperature {t} under "
                    "batch_invariant()"
                )
