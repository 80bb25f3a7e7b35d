"""samebits' ops as `torch.library` custom ops: the HF-order ops and the MoE experts.

Each HF-order op runs exactly the aten sequence of the transformers module it mirrors
(named in its docstring), so it gives transformers' bits; as an opaque custom op with a
fake kernel, `torch.compile` cannot fuse or reorder it and CUDA-graph capture keeps it as
it is. Inside `batch_invariant()` the reductions these sequences call (mean, softmax, sum)
go through the same row-invariant kernels as the transformers module does there.

The names exported here are `EagerOp`s over those custom ops: an eager call runs the op's
kernel directly where that cannot differ from the op (`numerics/eager_op.py`: custom_op's
Python wrappers cost tens of us a call); `torch.ops.samebits.*` are the ops themselves.

Ops with a device or profile choice have a CPU body and a CUDA kernel that both ask the
registry (`numerics.registry.pick`): the registry's `TABLE` is where the choice is made.
"""

from __future__ import annotations

import torch

from samebits.numerics import composite, scope
from samebits.numerics.eager_op import EagerOp
from samebits.numerics.registry import pick
from samebits.numerics.warmup import warm_cpu_vector_math

Tensor = torch.Tensor
warm_cpu_vector_math()  # (before any model or trainer computes: numerics/warmup.py)


def rotary_inv_freq(head_dim: int, rope_theta: float) -> Tensor:
    """transformers' default `inv_freq`, computed on the CPU in fp32.

    The CUDA `pow` differs from the CPU one in the last bit for some
    frequencies, so this is always computed on the CPU and moved afterwards.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
    return 1.0 / (rope_theta**exponent)


@torch.library.custom_op("samebits::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3MoeRMSNorm: fp32 variance and rsqrt, cast, then `weight *` in the weight's dtype."""
    return pick("rms_norm", "cpu")(x, weight, eps)


@rms_norm.register_kernel("cuda")
def _(x, weight, eps):
    return pick("rms_norm", "cuda")(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("samebits::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`h = residual + x` rounded in the activation dtype, then `rms_norm(h)`; returns (h, norm)."""
    return pick("add_rms_norm", "cpu")(x, residual, weight, eps)


@add_rms_norm.register_kernel("cuda")
def _(x, residual, weight, eps):
    return pick("add_rms_norm", "cuda")(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    h = torch.empty_like(residual + x)
    return h, torch.empty_like(h, dtype=torch.promote_types(h.dtype, weight.dtype))


def _rotary_cos_sin(
    x: Tensor, position_ids: Tensor, inv_freq: Tensor, attention_scaling: float
) -> tuple[Tensor, Tensor]:
    """Qwen3MoeRotaryEmbedding.forward: position_ids (..., T) -> cos, sin (..., T, D) in x's dtype.

    `freqs = positions.float() * inv_freq` elementwise, cos/sin in fp32, then cast.
    """
    freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


rotary_cos_sin = torch.library.custom_op("samebits::rotary_cos_sin", _rotary_cos_sin, mutates_args=())


@rotary_cos_sin.register_fake
def _(x, position_ids, inv_freq, attention_scaling):
    shape = (*position_ids.shape, 2 * inv_freq.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


def _mrope_cos_sin(
    x: Tensor,
    position_ids: Tensor,
    inv_freq: Tensor,
    attention_scaling: float,
    mrope_section: list[int],
) -> tuple[Tensor, Tensor]:
    """Qwen3OmniMoeThinkerTextRotaryEmbedding.forward: (3, ..., T) T/H/W rows -> cos, sin.

    Frequency index i takes its position from row T, except the interleaved
    slots `1::3` (H) and `2::3` (W) within `3 * mrope_section[row]`.
    """
    position_ids = position_ids.expand(3, *position_ids.shape[1:])
    freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    cos = _mrope_interleave(freqs.cos() * attention_scaling, mrope_section)
    sin = _mrope_interleave(freqs.sin() * attention_scaling, mrope_section)
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _mrope_interleave(freq: Tensor, mrope_section: list[int]) -> Tensor:
    thw = freq[0].clone()  # [..., T, D/2]
    for row, offset in ((1, 1), (2, 2)):
        idx = slice(offset, mrope_section[row] * 3, 3)
        thw[..., idx] = freq[row, ..., idx]
    return torch.cat((thw, thw), dim=-1)


mrope_cos_sin = torch.library.custom_op("samebits::mrope_cos_sin", _mrope_cos_sin, mutates_args=())


@mrope_cos_sin.register_fake
def _(x, position_ids, inv_freq, attention_scaling, mrope_section):
    shape = (*position_ids.shape[1:], 2 * inv_freq.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


@torch.library.custom_op("samebits::apply_rotary", mutates_args=())
def apply_rotary(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """apply_rotary_pos_emb: `q*cos + rotate_half(q)*sin`, each op rounding on its own."""
    return pick("apply_rotary", "cpu")(q, k, cos, sin, unsqueeze_dim)


@apply_rotary.register_kernel("cuda")
def _(q, k, cos, sin, unsqueeze_dim=1):
    return pick("apply_rotary", "cuda")(q, k, cos, sin, unsqueeze_dim)


@apply_rotary.register_fake
def _(q, k, cos, sin, unsqueeze_dim=1):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("samebits::router", mutates_args=())
def router(router_logits: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """Qwen3MoeTopKRouter after its linear: fp32 softmax, top-k, fp32 renorm, cast back.

    router_logits [T, E] -> (weights [T, top_k] in the logits dtype, indices [T, top_k]).
    """
    return pick("router", "cpu")(router_logits, top_k, norm_topk_prob)


@router.register_kernel("cuda")
def _(router_logits, top_k, norm_topk_prob):
    return pick("router", "cuda")(router_logits, top_k, norm_topk_prob)


@router.register_fake
def _(router_logits, top_k, norm_topk_prob):
    shape = (*router_logits.shape[:-1], top_k)
    return router_logits.new_empty(shape), router_logits.new_empty(shape, dtype=torch.long)


def _deepstack_add(hidden_states: Tensor, visual_pos_mask: Tensor, visual_embeds: Tensor) -> Tensor:
    """Thinker `_deepstack_process`: add visual embeds to the *full* hidden state a layer returns.

    hidden [..., H], visual_pos_mask [...] bool with N_visual rows set, visual_embeds
    [N_visual, H]. transformers' `out[mask, :] = out[mask, :] + embeds`, without its host sync
    (a boolean index waits for the device to count the rows): masked row r gets embeds[k], k
    the masked rows before it (boolean indexing's order), by a gather, and the same add; the
    other rows are copied. The same bits."""
    visual_embeds = visual_embeds.to(hidden_states.device, hidden_states.dtype)
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])  # [N, H]
    if visual_embeds.shape[0] == 0:
        return hidden_states.clone()
    mask = visual_pos_mask.reshape(-1, 1)  # [N, 1]
    rank = (mask[:, 0].cumsum(0) - 1).clamp(min=0)  # [N]: the visual row each masked row takes
    return torch.where(mask, flat + visual_embeds[rank], flat).reshape(hidden_states.shape)


deepstack_add = torch.library.custom_op("samebits::deepstack_add", _deepstack_add, mutates_args=())


@deepstack_add.register_fake
def _(hidden_states, visual_pos_mask, visual_embeds):
    return torch.empty_like(hidden_states)


def projections(x: torch.Tensor, weights: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, w)` for each weight (no bias), in order: a layer's q/k/v projections. On
    CUDA the registry runs them as one GEMM when the weights lie back to back in one storage
    (the loader's layout), with each column's bits unchanged; the outputs are then column
    views of one [T, sum N] tensor."""
    return pick("projections", x.device.type)(x, weights)


def experts_slots(
    hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor
) -> Tensor | None:
    """`experts` before its top-k sum: [T, K, H] fp32 weighted slot outputs, for the next norm to
    sum (`slot_add_rms_norm`); None where this device and profile have no such step, or where
    autograd is recording (the differentiable op is `experts`): then call `experts`."""
    if torch.is_grad_enabled() and any(
        t.requires_grad for t in (hidden_states, top_k_weights, gate_up_proj, down_proj)
    ):
        return None
    return pick("experts_slots", hidden_states.device.type)(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj
    )


def sum_slots(slots: Tensor, dtype: torch.dtype) -> Tensor:
    """[T, K, H] fp32 weighted slot outputs -> [T, H] in `dtype`: the experts' closing top-k sum."""
    return pick("sum_slots", slots.device.type)(slots, dtype)


def slot_add_rms_norm(slots: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`add_rms_norm(sum_slots(slots, residual.dtype), residual, weight, eps)`: a MoE layer's
    output summed, added to the residual stream and normalized; on CUDA one launch."""
    return pick("slot_add_rms_norm", residual.device.type)(slots, residual, weight, eps)


def qk_norm_rope_cache(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> Tensor:
    """An attention layer's q/k RMSNorm (`rms_norm`), rotary (`apply_rotary`) and K/V cache
    writes: q [T, H, D], k/v [T, KVH, D] -> the rotated q; the rotated k and v are written into
    k_cache/v_cache [slots, KVH, D] at slot_mapping [T]. On CUDA the registry runs it as one
    launch with the op-by-op bits (`norm_rope_triton.qk_norm_rope_cache`)."""
    return pick("qk_norm_rope_cache", q.device.type)(
        q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slot_mapping
    )


def reported_logprobs(logits: torch.Tensor, temperatures: list[float] | torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> float32 log-probs [N, V], each row at its temperature (0 -> 1).

    The reported log-prob is, bit for bit, the line trainers write with `T` a Python float:

        torch.log_softmax(logits.float() / T, dim=-1)

    (inside `batch_invariant()` for the trainer's side, as the engine runs). That line
    divides by float32(T) on the CPU, but on CUDA aten turns a division by a Python scalar
    into a multiplication by the float32 reciprocal `1 / float32(T)` (BinaryDivTrueKernel.cu),
    which rounds differently. Here every row has its own temperature, so each device's rule
    is applied per row (the registry's `temperature_scale`): the CPU divides by the float32
    temperatures, CUDA multiplies by their float32 reciprocals.
    `temperatures` may already be a float32 tensor [N]; T = 1 (greedy) is the identity.
    """
    if isinstance(temperatures, torch.Tensor):
        temps = temperatures.float()
    else:
        temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=torch.float32)
    dev = logits.device
    return composite.reported_logprobs(logits, temps.to(dev), pick("temperature_scale", dev.type))


def sample_plain(
    logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, random_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode sample of rows with no banned tokens, top-k/top-p or top log-probs: logits
    [N, V], temps [N] float32 (1 for greedy rows), keys [N, 2] int64, random_row [N] bool ->
    (tokens [N], their reported log-probs [N] float32). Device ops only (CUDA-graph safe).

    Each row is the exponential race over exp(`reported_logprobs`) (`kernels.sample.race`);
    greedy rows take the best logit. The registry's `sample_plain` runs it op by op, or on CUDA
    as one fused kernel family with the same bits (`kernels/sample_triton.py`)."""
    return pick("sample_plain", logits.device.type)(logits, temps, keys, random_row)


def race(
    lps: torch.Tensor, probs: torch.Tensor, scores: torch.Tensor, keys: torch.Tensor, random_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponential race of rows whose probabilities were narrowed or banned (the sampler's
    rows with rules): lps [N, V] float32 (the reported log-probs), probs [N, V] float32, scores
    [N, V] (greedy rows and the underflow fallback) -> (tokens [N], their log-probs [N]).
    `kernels.sample.race`'s bits on every device; on CUDA one launch (the registry's `race`)."""
    return pick("race", probs.device.type)(lps, probs, scores, keys, random_row)


@torch.library.custom_op("samebits::experts", mutates_args=())
def experts(
    hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor
) -> Tensor:
    """MoE experts (SiLU), transformers' layout: sum over k of `weight_k * down_e(silu(gate_e(x)) * up_e(x))`.

    hidden [T, H], top_k_index/weights [T, K], gate_up_proj [E, 2I, H] ([gate; up] on dim 1),
    down_proj [E, H, I] -> [T, H]. Exact profile: samebits' batch-invariant kernels (CPU
    `experts_ref`, CUDA Triton); fast profile: the stock twins. Engine and trainer both call it.
    """
    return pick("experts", "cpu")(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)


@experts.register_kernel("cuda")
def _(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return pick("experts", "cuda")(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)


@experts.register_fake
def _(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return torch.empty_like(hidden_states)


def _experts_setup(ctx, inputs, output):
    x, index, weights, gate_up, down = inputs
    ctx.save_for_backward(x, index, weights, gate_up, down)
    ctx.profile = scope.profile_name()  # the backward recomputes what this forward ran


def _experts_backward(ctx, grad_out):
    """The registry's `experts_backward` for this device and the forward's profile."""
    x, index, weights, gate_up, down = ctx.saved_tensors
    needs = ctx.needs_input_grad
    backward = pick("experts_backward", x.device.type, ctx.profile)
    wants = (needs[0], needs[2], needs[3], needs[4])
    gx, gw, ggu, gd = backward(grad_out, x, index, weights, gate_up, down, wants)
    return gx, None, gw, ggu, gd


experts.register_autograd(_experts_backward, setup_context=_experts_setup)


class _ExpertsGrad(torch.autograd.Function):
    """`experts` where autograd records, called eagerly: the op's kernel forward and the op's
    backward, without the op's wrappers (numerics/eager_op.py)."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
        inputs = (hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
        _experts_setup(ctx, inputs, None)
        with torch._C._AutoDispatchBelowAutograd():  # as the op runs its kernel
            return pick("experts", hidden_states.device.type)(*inputs)

    backward = staticmethod(_experts_backward)


def _picked(name: str):
    """The kernels of an op whose body and CUDA kernel are `pick(name, device)` (picked per call:
    the profile is the calling thread's)."""
    return lambda device: pick(name, device)


# Eager calls run the kernels directly where that cannot differ from the op (numerics/eager_op.py).
rms_norm = EagerOp(rms_norm, _picked("rms_norm"))
add_rms_norm = EagerOp(add_rms_norm, _picked("add_rms_norm"))
rotary_cos_sin = EagerOp(rotary_cos_sin, lambda device: _rotary_cos_sin)
mrope_cos_sin = EagerOp(mrope_cos_sin, lambda device: _mrope_cos_sin)
apply_rotary = EagerOp(apply_rotary, _picked("apply_rotary"))
router = EagerOp(router, _picked("router"))
deepstack_add = EagerOp(deepstack_add, lambda device: _deepstack_add)
experts = EagerOp(experts, _picked("experts"), grad=_ExpertsGrad)
