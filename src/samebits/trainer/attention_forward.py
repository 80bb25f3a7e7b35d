"""samebits' forward for a transformers Qwen3-MoE attention block: one autograd node, not ~30.

Inside `batch_invariant()` transformers' `Qwen3MoeAttention.forward` is, per layer, three
linears, two RMSNorms, `apply_rotary_pos_emb` (fourteen elementwise ops), the attention
interface (transposes, the packed attention) and the output linear: ~35 host ops forward and
six Python autograd nodes plus ~25 C++ ones backward. The trainer's micro-batches are bound by
that host time (docs/performance.md). `use_samebits_forwards` swaps such a module's class for one
whose forward, where the module would reach samebits' kernels anyway, runs the engine's layer
instead, as one `_AttentionBlock`:

    q, k, v = linears(x, [Wq, Wk, Wv])              # on CUDA one GEMM over the joined weights
    q, k', v' = qk_norm_rope_cache(q, k, v, ...)    # on CUDA one launch: both norms, rotary, copies
    out = attention(q, k', v') per row              # the packed attention op
    y = out @ Wo.T

each the registry's kernel with the modules' bits (tested: `test_trainer_forwards.py`, and the
engine's layer against the trainer's at 48 layers). The backward is closed-form on stock
kernels (gradients carry no bitwise contract): the two linears' GEMMs, the attention's
device backward, the norms' and rotary's `qk_norm_rope_backward` (on CUDA one launch).

Anything else runs the module's own forward: outside the context, under autocast, with a KV
cache, an attention mask, dropout, another attention implementation, inputs of another dtype
than the weights, or sub-modules that are no longer samebits' swapped linears and norms or that
carry hooks (the block would skip them).
"""

from __future__ import annotations

import functools

import torch
from torch.nn.modules import module as nn_module

from samebits.model.attention import _BACKWARD, _backward_cpu, attention
from samebits.numerics.registry import pick
from samebits.trainer.forwards import SamebitsLinear, _direct, _grad, _rms_norm_forward
from samebits.trainer.registration import _row_batches


@functools.lru_cache(maxsize=64)
def _slots(t: int, device: torch.device) -> torch.Tensor:
    """Row i of the step's K/V goes to row i of its own buffer: [T] 0..T-1."""
    return torch.arange(t, device=device)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b on the out= overload (the backward runs outside the context, on autograd's device
    thread on CUDA, where the functional `mm` would cross the overrides' Python wrapper)."""
    return torch.mm(a, b, out=a.new_empty(a.shape[0], b.shape[1]))


def _block(x, wq, wk, wv, wo, wqn, wkn, cos, sin, batches, spec):
    """The block's forward -> (output [B, S, hidden], what its backward reads)."""
    d, eps, scale = spec
    b, s = x.shape[:2]
    t, dev = b * s, x.device.type
    x2 = x.reshape(t, -1)
    q, k, v = (y.view(t, -1, d) for y in pick("linears", dev)(x2, (wq, wk, wv)))  # [T, heads, D]
    cos2, sin2 = (c.expand(b, s, d).reshape(t, d) for c in (cos, sin))  # [T, D]
    k_r, v_c = k.new_empty(k.shape), v.new_empty(v.shape)  # the block's own K/V "cache"
    q_r = pick("qk_norm_rope_cache", dev)(q, k, v, wqn, wkn, eps, cos2, sin2, k_r, v_c, _slots(t, x.device))
    rows = [slice(i * s, (i + 1) * s) for i in range(b)]
    outs = [attention(q_r[r], k_r[r], v_c[r], batch, scale) for r, batch in zip(rows, batches, strict=True)]
    out = outs[0] if b == 1 else torch.cat(outs)  # [T, H, D]
    y = pick("matmul", dev)(out.view(t, -1), wo.t()).view(b, s, -1)
    return y, (x2, q, k, q_r, k_r, v_c, out, cos2, sin2, rows)


class _AttentionBlock(torch.autograd.Function):
    """x [B, S, hidden] -> [B, S, hidden]: the attention block of one layer (module docstring).
    `cos`/`sin` [B or 1, S, D] are transformers' position embeddings; `batches` one packed
    `AttentionBatch` per row; `spec` (head_dim, eps, scale)."""

    @staticmethod
    def forward(ctx, x, wq, wk, wv, wo, wqn, wkn, cos, sin, batches, spec):
        y, (x2, q, k, q_r, k_r, v_c, out, cos2, sin2, rows) = _block(
            x, wq, wk, wv, wo, wqn, wkn, cos, sin, batches, spec
        )
        ctx.save_for_backward(x2, wq, wk, wv, wo, wqn, wkn, q, k, q_r, k_r, v_c, out, cos2, sin2)
        ctx.spec, ctx.rows = spec, rows
        ctx.bounds = [(batch.query_start_loc_cpu.tolist(), batch.query_start_loc) for batch in batches]
        return y

    @staticmethod
    def backward(ctx, grad):
        x2, wq, wk, wv, wo, wqn, wkn, q, k, q_r, k_r, v_c, out, cos2, sin2 = ctx.saved_tensors
        _, eps, scale = ctx.spec
        need = ctx.needs_input_grad
        t = x2.shape[0]
        g = grad.reshape(t, -1)  # [T, hidden]
        dwo = _mm(g.t(), out.view(t, -1)) if need[4] else None
        if not any(need[i] for i in (0, 1, 2, 3, 5, 6)):  # all below it frozen: o_proj's grad only
            return None, None, None, None, dwo, *[None] * 6
        d_out = _mm(g, wo).view(out.shape)  # [T, H, D]
        backward = _BACKWARD.get(x2.device.type, _backward_cpu)
        parts = [
            backward(d_out[r], q_r[r], k_r[r], v_c[r], bounds, scale, cu)
            for r, (bounds, cu) in zip(ctx.rows, ctx.bounds, strict=True)
        ]
        dq_r, dk_r, dv = (p[0] if len(parts) == 1 else torch.cat(p) for p in zip(*parts, strict=True))
        dqkv, dwqn, dwkn = pick("qk_norm_rope_backward", x2.device.type)(
            dq_r, dk_r, dv, q, k, wqn, wkn, eps, cos2, sin2, (need[5], need[6])
        )  # [T, (H + 2 KVH) D], the joined GEMM's columns
        dx = _mm(dqkv, torch.cat((wq, wk, wv))).view(*grad.shape[:-1], -1) if need[0] else None
        dw = [None] * 3
        if any(need[1:4]):
            dw = _mm(dqkv.t(), x2).split([w.shape[0] for w in (wq, wk, wv)])
        return dx, *(w if n else None for w, n in zip(dw, need[1:4], strict=True)), dwo, dwqn, dwkn, *[None] * 4


def _parts_as_swapped(self) -> bool:
    """The block stands in for its sub-modules' forwards: only while they are still samebits'
    swapped linears and norms with no hooks (a hook, or an adapter such as PEFT's LoRA put in a
    projection's place, would be skipped)."""
    linears = (self.q_proj, self.k_proj, self.v_proj, self.o_proj)
    parts = (*linears, self.q_norm, self.k_norm)
    return (
        all(type(m) is SamebitsLinear for m in linears)
        and type(self.q_norm).forward is _rms_norm_forward
        and type(self.k_norm).forward is _rms_norm_forward
        and not any(
            m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
            for m in parts
        )
        and not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)
        and not (nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)
    )


def attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    """transformers' `Qwen3MoeAttention.forward` -> (output, None): `_AttentionBlock` where it
    has the module's bits (module docstring), the module's own forward otherwise. The KV cache
    comes as `past_key_values` (transformers < 5.24) or `cache` (5.24 renamed it); it goes on
    to the module's own forward as its fourth argument, which is either name."""
    if past_key_values is None:
        past_key_values = kwargs.pop("cache", None)
    cos, sin = position_embeddings
    if not _parts_as_swapped(self):
        return self._samebits_base.forward(
            self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs
        )
    linears = (self.q_proj, self.k_proj, self.v_proj, self.o_proj)
    weights = [m.weight for m in linears] + [self.q_norm.weight, self.k_norm.weight]
    if not (
        past_key_values is None
        and attention_mask is None
        and (not self.training or not self.attention_dropout)
        and self.config._attn_implementation == "samebits"
        and hidden_states.dim() == 3
        and _direct(hidden_states)
        and all(w.dtype == hidden_states.dtype for w in weights)
        and cos.dim() == 3
        and cos.shape[1:] == (hidden_states.shape[1], self.head_dim)
        and cos.dtype == hidden_states.dtype
        and not (cos.requires_grad or sin.requires_grad)
    ):
        return self._samebits_base.forward(
            self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs
        )
    b, s = hidden_states.shape[:2]
    batches = _row_batches(kwargs.get("position_ids"), b, s, hidden_states.device)
    spec = (self.head_dim, self.q_norm.variance_epsilon, self.scaling)
    inputs = (hidden_states, *weights, cos, sin, batches, spec)
    if _grad(hidden_states, *weights):
        return _AttentionBlock.apply(*inputs), None
    return _block(*inputs)[0], None
