"""A transformers that no longer computes the engine's bits is refused by name (`trainer/drift.py`),
and hub kernels are kept out of the trainer (`trainer/hub_kernels.py`).

Claims: on this transformers every probe passes, for Qwen3-MoE and the Omni thinker, for
`load_hf_model` and for a user's own `AutoModelForCausalLM` with samebits' implementations,
whose log-probs are then the engine's bit for bit. Controls, each the same model with one piece
of transformers changed the way a release could change it: the RMSNorm's rounding moved, the
rotary angles rounded to bf16, the rotary application rounded once, the router's renorm in
bf16, the residuals summed in another order, the log-prob line in bf16, M-RoPE without its H/W
sections, the deepstack rows placed in another order. Each is refused naming the piece, the
module and the transformers version. A hub kernel put over a module's forward (the way
`kernels.kernelize` does it: the module's own `forward` and `_kernel_repo`) is switched back
with a warning naming it; without one, no warning.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import transformers
from omni_transformers import needs_omni_transformers
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from samebits import LLM, SamplingParams, batch_invariant, trainer
from samebits.trainer import drift, line
from samebits.trainer.hub_kernels import HubKernelError
from samebits.verify import make_prompts

VERSION = transformers.__version__


@pytest.fixture(scope="module")
def model(tiny):
    return trainer.load_hf_model(tiny)


def _recheck(model):
    drift._PROBED.discard(model)
    trainer.check_transformers_numerics(model)


def _pieces(model, monkeypatch) -> list[str]:
    seen = []
    real = drift._refuse

    def record(piece, module, got, want):
        seen.append(piece)
        real(piece, module, got, want)

    monkeypatch.setattr(drift, "_refuse", record)
    _recheck(model)
    return seen


def test_every_piece_is_probed_and_passes(model, monkeypatch):
    pieces = _pieces(model, monkeypatch)
    assert pieces.count("RMSNorm") == 1  # one norm class in Qwen3-MoE
    for piece in ("rotary", "rotary application", "router", "residual order"):
        assert piece in pieces
    assert [p for p in pieces if p.startswith("log-prob line")] == [
        "log-prob line at T=0.7",
        "log-prob line at T=1.0",
        "log-prob line at T=1.3",
    ]


def test_a_model_that_passed_is_not_probed_again(model, monkeypatch):
    trainer.check_transformers_numerics(model)
    calls = []
    monkeypatch.setattr(drift, "_probes", lambda m: calls.append(m) or [])
    trainer.check_transformers_numerics(model)
    assert calls == []


# -- controls: one piece of transformers changed as a release could change it -----------------


def _norm_rounding_moved(self, hidden_states):  # weight * h in fp32, rounded once
    dtype = hidden_states.dtype
    h = hidden_states.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight.float() * h).to(dtype)


def _rotary_angles_in_bf16(self, x, position_ids):
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1).to(x.dtype)  # the angles rounded before cos/sin
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _rotary_rounded_once(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim).float(), sin.unsqueeze(unsqueeze_dim).float()

    def rotate(x):
        return (x.float() * cos + hf.rotate_half(x).float() * sin).to(x.dtype)

    return rotate(q), rotate(k)


def _router_renorm_in_bf16(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    top = top.to(logits.dtype)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, idx


def _residuals_summed_once(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
    kwargs.pop("past_key_values", None)
    kwargs.pop("use_cache", None)
    attn, _ = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states),
        attention_mask=attention_mask,
        position_ids=position_ids,
        **kwargs,
    )
    mlp = self.mlp(self.post_attention_layernorm(hidden_states + attn))
    return hidden_states + (attn + mlp)  # x + (a + m) where Qwen3 adds (x + a) + m


def _line_in_bf16(rows, temperature):
    return torch.log_softmax(rows / temperature, dim=-1).float()


CONTROLS = {
    "RMSNorm": (hf.Qwen3MoeRMSNorm, "forward", _norm_rounding_moved, "Qwen3MoeRMSNorm"),
    "rotary": (hf.Qwen3MoeRotaryEmbedding, "forward", _rotary_angles_in_bf16, "Qwen3MoeRotaryEmbedding"),
    "rotary application": (hf, "apply_rotary_pos_emb", _rotary_rounded_once, "apply_rotary_pos_emb"),
    "router": (hf.Qwen3MoeTopKRouter, "forward", _router_renorm_in_bf16, "Qwen3MoeTopKRouter"),
    "residual order": (hf.Qwen3MoeDecoderLayer, "forward", _residuals_summed_once, "Qwen3MoeDecoderLayer"),
    "log-prob line": (line, "trainer_logprobs", _line_in_bf16, "trainer_logprobs"),
}


@pytest.mark.parametrize("piece", CONTROLS)
def test_control_a_changed_piece_is_refused_by_name(model, monkeypatch, piece):
    owner, attr, changed, module = CONTROLS[piece]
    _recheck(model)  # the same model passes as it is
    monkeypatch.setattr(owner, attr, changed)
    with pytest.raises(drift.TransformersDriftError) as err:
        _recheck(model)
    msg = str(err.value)
    assert f"transformers {VERSION}" in msg and module in msg and f"({piece}" in msg
    assert "differs from samebits' engine in" in msg and "scripts/constraints.txt" in msg


def test_control_load_hf_model_refuses_before_returning(tiny, monkeypatch):
    monkeypatch.setattr(hf.Qwen3MoeRMSNorm, "forward", _norm_rounding_moved)
    with pytest.raises(drift.TransformersDriftError, match="Qwen3MoeRMSNorm"):
        trainer.load_hf_model(tiny)


def test_control_token_logprobs_refuses_a_users_model_by_name(tiny, monkeypatch):
    user = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16, use_kernels=False)
    monkeypatch.setattr(hf.Qwen3MoeTopKRouter, "forward", _router_renorm_in_bf16)
    with pytest.raises(drift.TransformersDriftError, match="Qwen3MoeTopKRouter"):
        trainer.token_logprobs(user, [list(range(3, 20))], [4])


# -- a user's plain AutoModelForCausalLM ------------------------------------------------------


def _engine_outputs(tiny):
    llm = LLM(tiny, dtype="bfloat16", max_num_seqs=4, max_model_len=96)
    prompts = make_prompts((7, 13, 21), llm.config.vocab_size, seed=8)
    params = [SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=s) for s in (1, 2, 3)]
    return llm.generate(prompts, params)


def _users_logprobs(tiny, outs, attn):
    user = AutoModelForCausalLM.from_pretrained(
        tiny, dtype=torch.bfloat16, experts_implementation="samebits", attn_implementation=attn
    )
    trainer.use_samebits_forwards(user)  # runs the drift check on the user's model
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    with batch_invariant():
        return trainer.token_logprobs(user, seqs, [len(o.prompt_token_ids) for o in outs], temperature=0.9)


def test_a_users_plain_auto_model_gives_the_engines_bits(tiny):
    outs = _engine_outputs(tiny)
    for out, lp in zip(outs, _users_logprobs(tiny, outs, "samebits"), strict=True):
        assert torch.equal(out.logprobs, lp), (out.logprobs != lp).sum()
    # control: the same user model on transformers' sdpa attention (other op order) differs
    neg = _users_logprobs(tiny, outs, "sdpa")
    assert sum(int((o.logprobs != lp).sum()) for o, lp in zip(outs, neg, strict=True)) > 0


# -- hub kernels ------------------------------------------------------------------------------


def _liger_like(self, hidden_states):  # another RMSNorm's bits, as a hub kernel's would be
    return _norm_rounding_moved(self, hidden_states)


def _logits(model):
    ids = torch.tensor([list(range(3, 40))])
    with batch_invariant():
        return model(input_ids=ids, use_cache=False).logits


def test_a_hub_kernel_over_a_norm_is_switched_back_with_a_warning(tiny):
    model = trainer.load_hf_model(tiny)
    clean = _logits(model)
    norm = model.model.layers[0].input_layernorm
    norm.forward = types.MethodType(_liger_like, norm)  # what kernels' _replace_forward sets
    norm.__dict__["_kernel_repo"] = "kernels-community/liger-kernels"
    assert not torch.equal(_logits(model), clean)  # the kernel changes the bits: switching back matters
    with pytest.warns(
        UserWarning, match=r"model\.layers\.0\.input_layernorm \(kernels-community/liger-kernels\)"
    ):
        trainer.check_transformers_numerics(model)
    assert "forward" not in norm.__dict__ and "_kernel_repo" not in norm.__dict__
    assert torch.equal(_logits(model), clean)


class _Func(torch.nn.Module):  # the shape of kernels' function module (`use_kernel_forward_from_hub`)
    def forward(self, *args, **kwargs):
        return hf.apply_rotary_pos_emb(*args, **kwargs)


def test_a_hub_kernel_over_the_rotary_function_is_switched_back_with_a_warning(tiny):
    model = trainer.load_hf_model(tiny, samebits_forwards=False)
    attn = model.model.layers[1].self_attn
    func = _Func()
    func.forward = _rotary_rounded_once
    func.__dict__["_kernel_repo"] = "kernels-community/rotary"
    attn.__dict__["_kernel_funcs"] = {"apply_rotary_pos_emb": func}
    with pytest.warns(
        UserWarning, match=r"layers\.1\.self_attn\.apply_rotary_pos_emb \(kernels-community/rotary\)"
    ):
        trainer.check_transformers_numerics(model)
    assert "forward" not in func.__dict__ and "_kernel_repo" not in func.__dict__


def test_control_without_a_hub_kernel_no_warning(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = trainer.load_hf_model(tiny)
        trainer.check_transformers_numerics(model)


def test_use_kernels_turned_on_again_is_switched_off(model):
    model._use_kernels = True  # what from_pretrained(use_kernels=True) records; train() kernelizes by it
    trainer.check_transformers_numerics(model)
    assert model._use_kernels is False


@pytest.mark.parametrize("kwargs", [{"use_kernels": True}, {"kernel_config": object()}])
def test_hub_kernels_asked_for_are_refused(tiny, kwargs):
    with pytest.raises(HubKernelError, match="use_kernels=False"):
        trainer.load_hf_model(tiny, **kwargs)


# -- the Omni thinker: M-RoPE and the deepstack add -------------------------------------------


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    from samebits.model.qwen3_omni.tiny import build_tiny_omni_checkpoint

    path = build_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni"), seed=0, layout="thinker")
    return trainer.load_hf_thinker(path)


def _mrope_without_sections(self, freq):
    return torch.cat((freq[0], freq[0]), dim=-1)  # T rows only, as a plain rotary would


def _deepstack_rows_reordered(self, hidden_states, visual_pos_masks, visual_embeds):
    hidden_states = hidden_states.clone()
    hidden_states[visual_pos_masks, :] = hidden_states[visual_pos_masks, :] + visual_embeds.flip(0)
    return hidden_states


@needs_omni_transformers
def test_the_thinkers_pieces_are_probed_and_pass(thinker, monkeypatch):
    pieces = _pieces(thinker, monkeypatch)
    for piece in ("RMSNorm", "M-RoPE", "rotary application", "router", "residual order", "deepstack add"):
        assert piece in pieces


@pytest.mark.parametrize(
    "attr,changed,piece",
    [
        ("Qwen3OmniMoeThinkerTextRotaryEmbedding.recomposition_frequencies", _mrope_without_sections, "M-RoPE"),
        ("Qwen3OmniMoeThinkerTextModel._deepstack_process", _deepstack_rows_reordered, "deepstack add"),
    ],
)
@needs_omni_transformers
def test_control_the_thinkers_changed_piece_is_refused_by_name(thinker, monkeypatch, attr, changed, piece):
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as omni

    cls, name = attr.split(".")
    _recheck(thinker)
    monkeypatch.setattr(getattr(omni, cls), name, changed)
    with pytest.raises(drift.TransformersDriftError, match=rf"transformers {VERSION}: {cls}.*\({piece}\)"):
        _recheck(thinker)
