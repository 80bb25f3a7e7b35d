"""samebits' forwards for the trainer's linears, RMSNorms and routers (`trainer/forwards.py`).

Claim, bitwise: inside `batch_invariant()` a model with them gives the log-probs of the same
model on transformers' own module forwards, packed and one sequence at a time; outside it, the
stock forwards run. Controls: the same swap with one rounding of the RMSNorm moved (h rounded
after the weight product instead of before, as some RMSNorm variants do), the router's renorm
divided after the cast, or the linears summing K from the other end, changes the bits.
Gradients carry no bitwise contract: the closed-form backwards are checked against autograd in
float32.
"""

from __future__ import annotations

import pytest
import torch
from omni_transformers import needs_omni_transformers

from samebits import batch_invariant, trainer
from samebits.trainer import attention_forward, forwards

SEQS = [list(range(3, 40)), list(range(5, 20)), list(range(7, 60))]
PROMPT_LENS = [5, 3, 9]


def _logprobs(model, packed: bool, invariant: bool = True) -> list[torch.Tensor]:
    with batch_invariant() if invariant else torch.no_grad():
        return trainer.token_logprobs(model, SEQS, PROMPT_LENS, packed=packed)


@pytest.fixture(scope="module")
def pair(checkpoints):
    path = checkpoints["mixed"]
    return trainer.load_hf_model(path, samebits_forwards=False), trainer.load_hf_model(path)


def test_every_linear_norm_and_router_changed_once(pair):
    plain, fast = pair
    layers = fast.config.num_hidden_layers
    swapped = [m for m in fast.modules() if isinstance(m, forwards._Swapped)]
    routers = [m for m in fast.modules() if type(m).__name__ == "SamebitsQwen3MoeTopKRouter"]
    gates = [layer.mlp.gate for layer in fast.model.layers if hasattr(layer.mlp, "gate")]
    assert gates and len(routers) == len(gates) and all(a is b for a, b in zip(routers, gates, strict=True))
    attentions = [m for m in fast.modules() if type(m).__name__ == "SamebitsQwen3MoeAttention"]
    assert attentions == [layer.self_attn for layer in fast.model.layers]
    # per layer the attention, q/k/v/o and four norms (input, post-attention, q, k); the final
    # norm; the lm_head
    assert len(swapped) == 9 * layers + 2 + len(routers) + sum(
        isinstance(m, torch.nn.Linear) for layer in fast.model.layers for m in layer.mlp.modules()
    )
    assert not any(isinstance(m, forwards._Swapped) for m in plain.modules())
    assert trainer.use_samebits_forwards(fast) == 0  # idempotent


@pytest.mark.parametrize("packed", [True, False])
def test_same_bits_as_transformers_forwards(pair, packed):
    plain, fast = pair
    want, got = _logprobs(plain, packed), _logprobs(fast, packed)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_differentiable_path_gives_the_same_bits(checkpoints):
    """With gradients on (the update's forward), the swapped modules run their autograd
    Functions: the log-probs are still transformers' bits."""
    path = checkpoints["mixed"]
    models = [trainer.load_hf_model(path, samebits_forwards=flag).train() for flag in (False, True)]
    with batch_invariant():
        want, got = (trainer.token_logprobs(m, SEQS, PROMPT_LENS, packed=True, with_grad=True) for m in models)
    assert got[0].requires_grad
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(got, want, strict=True))


def test_under_autocast_the_modules_own_forwards_run(checkpoints):
    """Autocast casts a linear's inputs in aten, before the overrides: a float32 model under
    bf16 autocast (fp32 master weights, as HF Trainer with bf16=True runs) gives transformers'
    bits because the swapped modules step aside."""
    path = checkpoints["fp32"]
    models = [trainer.load_hf_model(path, dtype=torch.float32, samebits_forwards=f) for f in (False, True)]
    with batch_invariant(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = (trainer.token_logprobs(m, SEQS, PROMPT_LENS, packed=True) for m in models)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_save_and_copy_give_the_transformers_classes(pair, tmp_path):
    """A saved or copied model holds transformers' classes again (the pickle names no samebits
    class), with the same weights and, under batch_invariant(), the same bits."""
    import copy

    plain, fast = pair
    torch.save(fast, tmp_path / "model.pt")
    assert b"SamebitsLinear" not in (tmp_path / "model.pt").read_bytes()
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for other in (loaded, copy.deepcopy(fast), copy.copy(fast.lm_head)):
        assert not any(isinstance(m, forwards._Swapped) for m in other.modules())
    assert type(loaded.model.norm) is type(plain.model.norm)
    assert all(torch.equal(a, b) for a, b in zip(_logprobs(loaded, True), _logprobs(plain, True), strict=True))


def test_other_rms_norms_are_left_alone():
    """A norm whose forward is not Qwen3's (Gemma's `(1 + weight)` form) keeps its own forward."""

    class GemmaStyleRMSNorm(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.zeros(n)), 1e-6

        def forward(self, hidden_states):
            h = hidden_states.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (h * (1.0 + self.weight.float())).to(hidden_states.dtype)

    model = torch.nn.Sequential(GemmaStyleRMSNorm(8), torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(4, 2))
    assert trainer.use_samebits_forwards(model) == 1  # the bias-free linear only
    assert type(model[0]) is GemmaStyleRMSNorm and type(model[2]) is torch.nn.Linear


def test_outside_batch_invariant_the_stock_forwards_run(pair):
    plain, fast = pair
    want, got = _logprobs(plain, True, invariant=False), _logprobs(fast, True, invariant=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_control_a_norm_rounding_moved_changes_the_bits(pair, monkeypatch):
    plain, fast = pair

    def moved(x, weight, eps):  # weight * h in fp32, rounded once: one rounding fewer than Qwen3's
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return (weight.float() * h).to(torch.promote_types(x.dtype, weight.dtype))

    real = forwards.pick
    monkeypatch.setattr(forwards, "pick", lambda op, device: moved if op == "rms_norm" else real(op, device))
    got, want = _logprobs(fast, True), _logprobs(plain, True)
    assert any(not torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_control_a_router_rounding_moved_changes_the_bits(pair, monkeypatch):
    """The router with its renorm divided after the cast to the logits' dtype (one rounding
    moved): other bits, so the equality above sees the router's own roundings."""
    plain, fast = pair

    def moved(logits, top_k, norm_topk_prob):
        value, index = torch.topk(torch.softmax(logits.float(), -1), top_k, dim=-1)
        value = value.to(logits.dtype)
        return (value / value.sum(-1, keepdim=True) if norm_topk_prob else value), index

    real = forwards.pick
    monkeypatch.setattr(forwards, "pick", lambda op, device: moved if op == "router" else real(op, device))
    got, want = _logprobs(fast, True), _logprobs(plain, True)
    assert any(not torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_control_a_linear_summing_k_in_another_order_changes_the_bits(pair, monkeypatch):
    """The same products, each row's K summed from the other end (the registry's matmul on
    both operands reversed along K): other bits, so the equality above sees the linears' order."""
    plain, fast = pair
    real = forwards._matmul
    monkeypatch.setattr(forwards, "_matmul", lambda x, w: real(x.flip(-1), w.flip(-1)))
    got, want = _logprobs(fast, True), _logprobs(plain, True)
    assert any(not torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _count_blocks(monkeypatch) -> list[int]:
    """Count the attention blocks' forwards (`attention_forward._block`) from now on."""
    from samebits.trainer import attention_forward

    calls, real = [0], attention_forward._block

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(attention_forward, "_block", counted)
    return calls


def _rows_logits(model, positions: bool, grad: bool = False) -> torch.Tensor:
    """A [2, 24] batch straight through the model: one sequence per row, or (`positions`) two
    packed sequences per row, packed differently in each row, their positions restarting."""
    device = next(model.parameters()).device
    ids = (torch.arange(2 * 24, device=device).view(2, 24) % 50) + 3
    rows = [torch.cat([torch.arange(10), torch.arange(14)]), torch.cat([torch.arange(16), torch.arange(8)])]
    pos = torch.stack(rows).to(device) if positions else None
    with batch_invariant(), torch.set_grad_enabled(grad):
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits


@pytest.mark.parametrize("positions", [False, True])
def test_the_attention_block_over_several_rows_gives_the_same_bits(pair, monkeypatch, positions):
    """Rows of a [B, S] forward, one sequence each or packed: the swapped attention (one
    `_AttentionBlock` a layer) gives the logits of transformers' attention forward."""
    plain, fast = pair
    calls = _count_blocks(monkeypatch)
    got, want = _rows_logits(fast, positions), _rows_logits(plain, positions)
    assert calls[0] == fast.config.num_hidden_layers
    assert torch.equal(got, want)


def test_the_attention_block_steps_aside_with_a_kv_cache(pair, monkeypatch):
    """With a KV cache (use_cache=True) the module's own forward runs, with its bits."""
    plain, fast = pair
    calls = _count_blocks(monkeypatch)
    ids = torch.arange(20)[None] + 3
    with batch_invariant():
        got, want = (m(input_ids=ids, use_cache=True).logits for m in (fast, plain))
    assert calls[0] == 0 and torch.equal(got, want)


def test_the_attention_block_with_only_o_proj_trained(checkpoints):
    """Everything below o_proj frozen: the block's backward stops after o_proj's weight grad,
    which is autograd's (fp32)."""
    path = checkpoints["fp32"]
    plain, fast = (trainer.load_hf_model(path, dtype=torch.float32, samebits_forwards=f) for f in (False, True))

    def grads(model):
        for name, p in model.named_parameters():
            p.requires_grad_("o_proj" in name)
        _rows_logits(model, positions=True, grad=True).float().square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want, got = grads(plain), grads(fast)
    assert got.keys() == want.keys() and len(got) == plain.config.num_hidden_layers
    for name in want:
        assert ((got[name] - want[name]).norm() / want[name].norm()).item() < 1e-5, name


def test_the_attention_block_steps_aside_for_hooks_on_its_parts(pair, monkeypatch):
    """A forward hook on a projection (or an adapter put in its place) must run: the module's own
    forward takes over, with the same result as transformers' modules with the same hook."""
    plain, fast = pair
    handles = [
        m.self_attn.q_proj.register_forward_hook(lambda mod, args, out: out * 0.5)
        for model in (plain, fast)
        for m in model.model.layers
    ]
    try:
        calls = _count_blocks(monkeypatch)
        got, want = _logprobs(fast, True), _logprobs(plain, True)
    finally:
        for h in handles:
            h.remove()
    assert calls[0] == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(got, _logprobs(plain, True), strict=True))  # it ran


def test_control_the_blocks_rotary_rounded_once_changes_the_bits(pair, monkeypatch):
    """The block's rotary computed in fp32 and rounded once, where transformers rounds q*cos,
    rotate_half(q)*sin and their sum each to bf16: other bits, so the equalities above see the
    block's own roundings."""
    from samebits.trainer import attention_forward

    plain, fast = pair
    real = attention_forward.pick

    def rounded_once(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots):
        norm = real("rms_norm", q.device.type)
        c, s = cos[:, None].float(), sin[:, None].float()

        def rotate(x):
            x32, half = x.float(), x.shape[-1] // 2
            return (x32 * c + torch.cat((-x32[..., half:], x32[..., :half]), -1) * s).to(x.dtype)

        k_cache[slots] = rotate(norm(k, k_weight, eps))
        v_cache[slots] = v
        return rotate(norm(q, q_weight, eps))

    monkeypatch.setattr(
        attention_forward, "pick", lambda op, dev: rounded_once if op == "qk_norm_rope_cache" else real(op, dev)
    )
    got, want = _logprobs(fast, True), _logprobs(plain, True)
    assert any(not torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_attention_blocks_gradients_over_rows_match_autograd_in_float32(checkpoints):
    """The block's closed-form backward over two rows of two packed sequences each: the
    gradients of autograd through transformers' attention forward (fp32)."""
    path = checkpoints["fp32"]
    plain, fast = (trainer.load_hf_model(path, dtype=torch.float32, samebits_forwards=f) for f in (False, True))

    def grads(model):
        _rows_logits(model, positions=True, grad=True).float().square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if "self_attn" in n and p.grad is not None}

    want = grads(plain)
    with pytest.MonkeyPatch.context() as mp:
        calls = _count_blocks(mp)
        got = grads(fast)
    assert calls[0] == fast.config.num_hidden_layers  # the block's own backward ran
    assert got.keys() == want.keys() and len(got) == 6 * plain.config.num_hidden_layers  # q/k/v/o, q/k norms
    for name in want:
        assert ((got[name] - want[name]).norm() / want[name].norm()).item() < 1e-5, name


def test_gradients_match_autograd_in_float32(checkpoints):
    path = checkpoints["fp32"]
    plain = trainer.load_hf_model(path, dtype=torch.float32, samebits_forwards=False)
    fast = trainer.load_hf_model(path, dtype=torch.float32)

    def grads(model):
        with batch_invariant():
            lps = trainer.token_logprobs(model, SEQS, PROMPT_LENS, packed=True, with_grad=True)
            torch.cat(lps).square().sum().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want, got = grads(plain), grads(fast)
    assert got.keys() == want.keys() and any("norm" in n for n in got) and any("q_proj" in n for n in got)
    assert any("mlp.gate.weight" in n for n in got)  # the router's closed-form backward
    for name in want:  # float32 rounding apart: ~1e-7 of the gradient's norm
        assert ((got[name] - want[name]).norm() / want[name].norm()).item() < 1e-5, name


def test_the_routers_gradients_with_the_aux_loss_match_autograd_in_float32(checkpoints):
    """With output_router_logits the loss adds transformers' load-balancing loss, which reads the
    router logits: the router node's backward takes their grad too. The routers' gradients match
    autograd's, and differ from those without the aux loss (so the logits' grad is in them)."""
    path = checkpoints["fp32"]
    plain, fast = (trainer.load_hf_model(path, dtype=torch.float32, samebits_forwards=f) for f in (False, True))
    ids = torch.tensor([[5, 9, 11, 3, 7, 2, 8, 6, 4, 10]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])

    def grads(model, aux):
        model.zero_grad(set_to_none=True)
        with batch_invariant():
            out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False, output_router_logits=aux)
        out.loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}

    want, got, without = grads(plain, True), grads(fast, True), grads(fast, False)
    assert got and got.keys() == want.keys()
    for name in want:
        assert ((got[name] - want[name]).norm() / want[name].norm()).item() < 1e-5, name
    assert any(not torch.allclose(got[n], without[n]) for n in got)


@pytest.mark.parametrize("shape", ["tied_top1", "bias_per_expert"])
def test_routers_without_renorm_same_bits_and_gradients(checkpoints, shape):
    """norm_topk_prob=False (top-1 of 5; top-3 of 3): the swapped router gives transformers'
    log-probs, and its closed-form backward autograd's router gradients (fp32)."""
    path = checkpoints[shape]
    plain, fast = (trainer.load_hf_model(path, dtype=torch.float32, samebits_forwards=f) for f in (False, True))
    assert not fast.config.norm_topk_prob and any(
        type(m).__name__.endswith("TopKRouter") for m in fast.modules()
    )

    def run(model):
        with batch_invariant():
            lps = trainer.token_logprobs(model, SEQS, PROMPT_LENS, packed=True, with_grad=True)
            torch.cat(lps).square().sum().backward()
        return lps, {n: p.grad for n, p in model.named_parameters() if "mlp.gate" in n}

    (want, gw), (got, gg) = run(plain), run(fast)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(got, want, strict=True))
    assert gw and gg.keys() == gw.keys()
    for name in gw:
        assert ((gg[name] - gw[name]).norm() / gw[name].norm()).item() < 1e-5, name


@needs_omni_transformers
def test_the_omni_thinker_text_norms_and_routers_are_recognized(tmp_path):
    from samebits.model.qwen3_omni.tiny import build_tiny_omni_checkpoint

    model = trainer.load_hf_thinker(build_tiny_omni_checkpoint(tmp_path / "omni", seed=0, layout="thinker"))
    text = model.model.language_model
    norms = [m for m in text.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(isinstance(m, forwards._Swapped) for m in norms)
    routers = [m for m in text.modules() if type(m).__name__.endswith("TopKRouter")]
    assert routers and all(isinstance(m, forwards._Swapped) for m in routers)
    attentions = [m for m in text.modules() if type(m).__name__.endswith("TextAttention")]
    assert attentions and all(type(m).forward is attention_forward.attention_forward for m in attentions)


@pytest.mark.gpu
def test_on_cuda_same_bits_and_the_control_differs(checkpoints, monkeypatch):
    """On CUDA the norms are one fused Triton launch, the linears the Triton matmul (q/k/v one
    GEMM over the joined weights) and the q/k norms and rotary one launch, called directly: the
    same bits as transformers' modules under the overrides; the controls differ."""
    path = checkpoints["mixed"]
    plain = trainer.load_hf_model(path, device="cuda", samebits_forwards=False)
    fast = trainer.load_hf_model(path, device="cuda")
    calls = _count_blocks(monkeypatch)
    for packed in (True, False):
        want, got = _logprobs(plain, packed), _logprobs(fast, packed)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), packed
    assert calls[0] == (1 + len(SEQS)) * fast.config.num_hidden_layers  # the block ran every layer
    for positions in (False, True):
        assert torch.equal(_rows_logits(fast, positions), _rows_logits(plain, positions)), positions
    monkeypatch.undo()
    test_control_a_norm_rounding_moved_changes_the_bits((plain, fast), monkeypatch)
    monkeypatch.undo()
    test_control_a_router_rounding_moved_changes_the_bits((plain, fast), monkeypatch)
    monkeypatch.undo()
    test_control_a_linear_summing_k_in_another_order_changes_the_bits((plain, fast), monkeypatch)
    monkeypatch.undo()
    test_control_the_blocks_rotary_rounded_once_changes_the_bits((plain, fast), monkeypatch)


@pytest.mark.gpu
def test_on_cuda_the_attention_blocks_gradients_match_transformers(checkpoints, monkeypatch):
    """On CUDA the block's backward (o_proj's GEMMs, flash's backward per row, the q/k norm +
    rotary backward in one launch, the joined GEMM's): the attention parameters' gradients of
    transformers' forward through autograd, bf16, over two rows packed differently."""
    path = checkpoints["mixed"]
    plain, fast = (trainer.load_hf_model(path, device="cuda", samebits_forwards=f) for f in (False, True))

    def grads(model):
        _rows_logits(model, positions=True, grad=True).float().square().mean().backward()
        return {
            n: p.grad.float() for n, p in model.named_parameters() if "self_attn" in n and p.grad is not None
        }

    want = grads(plain)
    calls = _count_blocks(monkeypatch)
    got = grads(fast)
    assert calls[0] == fast.config.num_hidden_layers
    assert got.keys() == want.keys() and len(got) == 6 * plain.config.num_hidden_layers
    for name in want:  # bf16 roundings in other orders apart
        assert ((got[name] - want[name]).norm() / want[name].norm()).item() < 5e-2, name


_CUDA_PATH = """
import collections, importlib
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from samebits import trainer, batch_invariant
from samebits.kernels import experts_backward as eb
from samebits.model import attention
from samebits.model.qwen3_moe.tiny import TINY_SHAPE
from samebits.numerics import registry
from samebits.trainer import attention_forward

small = dict(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, head_dim=32)
small |= dict(num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2, num_experts=4)
small |= dict(mlp_only_layers=[])
cfg = Qwen3MoeConfig(**(TINY_SHAPE | small))
impl = dict(dtype=torch.float16, experts_implementation="samebits", attn_implementation="samebits")
torch.manual_seed(0)
plain, fast = AutoModelForCausalLM.from_config(cfg, **impl), AutoModelForCausalLM.from_config(cfg, **impl)
fast.load_state_dict(plain.state_dict())
for m in (plain, fast):
    trainer.reset_rotary_inv_freq(m)
ids = torch.tensor([[5, 9, 11, 3, 7, 2, 8, 6, 4, 10, 12, 13]])
pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])

def run(model):
    with batch_invariant():
        out = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    out.float().square().mean().backward()
    return out.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

want_logits, want = run(plain)  # transformers' modules, the CPU kernels
# the CUDA entries on CPU tensors (the prelude makes them report is_cuda), their Triton kernels
# run by the interpreter; the grouped GEMMs as a loop (torch's CPU one takes no such strides)
registry.triton_available = lambda: True
for name in ("linears", "qk_norm_rope_cache", "qk_norm_rope_backward", "experts", "experts_backward",
             "rms_norm", "rms_norm_backward", "matmul"):
    registry.TABLE[name]["cpu"] = registry.TABLE[name]["cuda"]
real_backward = eb.experts_backward
registry.experts_backward = lambda *a, **k: real_backward(*a, **k, gmm=eb.grouped_mm_loop)
attention._paged_attention.kernel = lambda device: attention._TRITON_ATTENTION
launches = collections.Counter()
counted_kernels = (
    ("norm_rope_triton", "qk_norm_rope_cache"),
    ("norm_rope_backward_triton", "qk_norm_rope_backward"),
    ("experts_backward_triton", "pointwise"),
    ("attention_launch", "paged_attention"),
)
for mod, fn in counted_kernels:
    module = importlib.import_module(f"samebits.kernels.{mod}")
    def counted(*a, _real=getattr(module, fn), _key=fn, **k):
        launches[_key] += 1
        return _real(*a, **k)
    setattr(module, fn, counted)
real_block = attention_forward._block
attention_forward._block = lambda *a: launches.update(["block"]) or real_block(*a)
trainer.use_samebits_forwards(fast)
got_logits, got = run(fast)
assert dict(launches) == {k: 2 for k in ("block", *(fn for _, fn in counted_kernels))}, launches
assert ((got_logits - want_logits).norm() / want_logits.norm()).item() < 2e-3
assert got.keys() == want.keys()
for name in want:
    assert ((got[name] - want[name]).norm() / want[name].norm()).item() < 3e-2, name
print("OK")
"""


def test_the_cuda_path_of_the_trainer_under_the_interpreter(monkeypatch):
    """The trainer's CUDA path end to end, without a GPU: the registry's linears, q/k norm +
    rotary (forward and backward), experts (forward and backward), norms and matmul on their
    CUDA entries, and the attention on its Triton kernel, run by Triton's CPU interpreter (the
    router stays on its CPU entry: its CUDA one checks for CUDA tensors), a packed forward +
    backward of two layers in fp16. It checks the plumbing (arguments, strides, layouts, which
    kernel runs) against the CPU path: logits and gradients close (not bitwise: the
    interpreter sums in numpy's order), every kernel ran. The GPU tests check the bits on the
    device."""
    from interpreted import run_interpreted

    run_interpreted(_CUDA_PATH)
