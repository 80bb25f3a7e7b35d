"""The Qwen3-MoE decoder, written once, with transformers' parameter names.

Numerics follow transformers' `modeling_qwen3_moe.py` op for op through the
HF-order ops in `samebits.numerics.ops`; attention and experts use samebits'
batch-invariant kernels, which the trainer's transformers model is given too.
The model knows nothing of scheduling: it takes flat tokens [T], their
positions [T] and an `AttentionBatch`, and returns hidden states [T, H].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from samebits.model.attention import AttentionBatch, attention
from samebits.model.qwen3_moe.config import ModelConfig
from samebits.numerics import ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.variance_epsilon)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scaling = cfg.head_dim**-0.5
        heads, kv_heads, bias = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta: AttentionBatch, kv_cache):
        t = x.shape[0]
        q, k, v = (y.view(t, -1, self.head_dim) for y in self.project_qkv(x))  # [T, H or KVH, D]
        q = ops.qk_norm_rope_cache(  # k, v go to the cache
            q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon,
            cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping,
        )  # fmt: skip
        out = attention(q, kv_cache[0], kv_cache[1], meta, self.scaling)
        return self.o_proj(out.reshape(t, -1))

    def project_qkv(self, x):
        """q, k, v projections of x [T, H] (`ops.projections`: one GEMM on CUDA when the
        loader put the three weights back to back)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if any(p.bias is not None for p in projs):
            return tuple(p(x) for p in projs)
        return ops.projections(x, [p.weight for p in projs])


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x):  # [T, H] -> weights [T, K], indices [T, K]
        return ops.router(F.linear(x, self.weight), self.top_k, self.norm_topk_prob)


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x, top_k_index, top_k_weights):
        return ops.experts(x, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


@dataclass
class Slots:
    """A MoE block's output before its top-k sum: the weighted slot outputs [T, K, H] fp32 and
    the activation dtype the sum rounds to. The next norm sums them in its own launch
    (`add_norm`); `summed()` is the block's output itself."""

    per_slot: torch.Tensor
    dtype: torch.dtype

    def summed(self) -> torch.Tensor:
        return ops.sum_slots(self.per_slot, self.dtype)


def dense(mlp_out: torch.Tensor | Slots) -> torch.Tensor:
    """An MLP output as the [T, H] tensor transformers' layer adds to its residual."""
    return mlp_out.summed() if isinstance(mlp_out, Slots) else mlp_out


def add_norm(mlp_out: torch.Tensor | Slots, residual: torch.Tensor, norm: RMSNorm):
    """transformers' `residual + mlp_out` (rounded in the activation dtype), then `norm` of it ->
    (the sum, its norm), in one launch where the device has it; a `Slots` output is summed in
    that launch too (`ops.slot_add_rms_norm`)."""
    if isinstance(mlp_out, Slots):
        return ops.slot_add_rms_norm(mlp_out.per_slot, residual, norm.weight, norm.variance_epsilon)
    return ops.add_rms_norm(mlp_out, residual, norm.weight, norm.variance_epsilon)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.experts = Experts(cfg)
        self.gate = Router(cfg)

    def forward(self, x):
        return dense(self.forward_slots(x))

    def forward_slots(self, x) -> torch.Tensor | Slots:
        """The block's output, or its weighted slot outputs before the top-k sum where this device
        and profile have that step (`ops.experts_slots`), for the next norm to sum."""
        weights, index = self.gate(x)
        e = self.experts
        per_slot = ops.experts_slots(x, index, weights, e.gate_up_proj, e.down_proj)
        if per_slot is not None:
            return Slots(per_slot, x.dtype)
        return e(x, index, weights)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SparseMoeBlock(cfg) if cfg.is_sparse_layer(layer_idx) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden, cos, sin, meta, kv_cache, mlp_out=None):
        """hidden [T, H]: the residual stream before this layer, less the previous layer's MLP
        output, which comes as `mlp_out` (None for the first layer): transformers' closing
        `residual + mlp_out` is made here, in the input norm's launch (`add_rms_norm`, the same
        bf16 rounding; a MoE layer's `Slots` are summed in that launch too). -> (residual, this
        layer's mlp_out), for the next layer or the final norm."""
        if mlp_out is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            residual, hidden = add_norm(mlp_out, hidden, self.input_layernorm)
        hidden = self.self_attn(hidden, cos, sin, meta, kv_cache)
        residual, hidden = add_norm(hidden, residual, self.post_attention_layernorm)
        mlp = self.mlp
        return residual, mlp.forward_slots(hidden) if isinstance(mlp, SparseMoeBlock) else mlp(hidden)


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", ops.rotary_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def forward(
        self, input_ids, positions, meta: AttentionBatch, kv_caches, inputs_embeds=None, **layer_inputs
    ):
        """input_ids [T] (or inputs_embeds [T, H] in their place), positions -> hidden [T, H].

        `layer_inputs` go to `decoder_layer`, where a model built on this one adds its own
        per-layer inputs (the Omni thinker: deepstack)."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, H]
        cos, sin = self.rotary(hidden, positions)  # [T, D]
        mlp_out = None  # the last layer's MLP output, added in the next norm (DecoderLayer.forward)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden, mlp_out = self.decoder_layer(
                i, layer, hidden, mlp_out, cos, sin, meta, kv_cache, **layer_inputs
            )
        if mlp_out is None:
            return self.norm(hidden)
        return add_norm(mlp_out, hidden, self.norm)[1]

    def rotary(self, hidden, positions):  # positions [T] -> cos, sin [T, D]
        return ops.rotary_cos_sin(hidden, positions, self.inv_freq, 1.0)

    def decoder_layer(self, i, layer, hidden, mlp_out, cos, sin, meta, kv_cache):
        """-> (residual, mlp_out) of layer i (`DecoderLayer.forward`)."""
        return layer(hidden, cos, sin, meta, kv_cache, mlp_out)


class Qwen3MoeForCausalLM(nn.Module):
    """Parameter names are transformers' (`model.layers.0.mlp.experts.gate_up_proj`, ...)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Qwen3MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttentionBatch, kv_caches) -> torch.Tensor:
        return self.model(input_ids, positions, meta, kv_caches)  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V] in the activation dtype, as transformers

    def finish_load(self) -> None:
        """After the weights are assigned: tie lm_head if the config says so; rotary
        `inv_freq` from the CPU fp32 formula, as the trainer's model gets it."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.model.inv_freq = ops.rotary_inv_freq(self.config.head_dim, self.config.rope_theta)
