"""The transformers side: rotary check, training through samebits kernels, input checks."""

from __future__ import annotations

import pytest
import torch

from samebits import batch_invariant, trainer


@pytest.fixture(scope="module")
def model(tiny):
    return trainer.load_hf_model(tiny, dtype=torch.bfloat16)


def test_rotary_inv_freq_check_raises_and_reset_fixes(tiny):
    m = trainer.load_hf_model(tiny, dtype=torch.bfloat16)
    trainer.check_rotary_inv_freq(m)
    inv = m.model.rotary_emb.inv_freq
    inv[3] = torch.nextafter(inv[3], torch.tensor(1.0))  # one ulp, as a CUDA pow can give
    with pytest.raises(trainer.RotaryMismatchError, match="reset_rotary_inv_freq"):
        trainer.token_logprobs(m, [[1, 2, 3]], [1])
    trainer.reset_rotary_inv_freq(m)
    trainer.check_rotary_inv_freq(m)


def test_trains_through_samebits_experts_and_attention(tiny):
    m = trainer.load_hf_model(tiny, dtype=torch.float32)
    m.train()
    assert m.config._experts_implementation == "samebits"
    assert m.config._attn_implementation == "samebits"
    ids = torch.tensor([[5, 9, 11, 3, 7, 2, 8, 6, 4, 10]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])  # two packed sequences
    with batch_invariant():
        loss = m(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    loss.backward()
    for name in (
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.gate.weight",
    ):
        g = dict(m.named_parameters())[name].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name


def test_packed_equals_one_at_a_time_and_negative_control(model, tiny):
    seqs = [[5, 9, 11, 3, 7, 2], [8, 6, 4, 10, 12, 13, 14, 15], [3, 3, 3]]
    plens = [2, 3, 1]
    with batch_invariant():
        single = trainer.token_logprobs(model, seqs, plens, packed=False)
        packed = trainer.token_logprobs(model, seqs, plens, packed=True)
    assert all(torch.equal(a, b) for a, b in zip(single, packed, strict=True))
    assert [len(x) for x in packed] == [4, 5, 2]
    # formula control: stock sdpa attention gives the packed row other bits than samebits'
    # (a formula change, not packing: at these widths stock kernels give packed = one at a
    # time, measured; the packing control, at hidden 2048, is in test_wide.py)
    stock = trainer.load_hf_model(tiny, dtype=torch.bfloat16, attn_implementation="sdpa")
    with batch_invariant():
        sdpa = trainer.token_logprobs(stock, seqs, plens, packed=True)
    assert any(not torch.equal(a, b) for a, b in zip(sdpa, packed, strict=True))


def test_token_logprobs_input_checks(model):
    with pytest.raises(ValueError, match="2 sequences but 1 prompt_lens"):
        trainer.token_logprobs(model, [[1, 2], [3, 4]], [1])
    with pytest.raises(ValueError, match="sequence 0: prompt_len 0"):
        trainer.token_logprobs(model, [[1, 2]], [0])


def test_samebits_attention_refuses_a_padding_mask(model):
    ids = torch.tensor([[5, 9, 11], [3, 7, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match="no padding mask"):
        model(input_ids=ids, attention_mask=mask, use_cache=False)


def test_packed_positions_are_read_once_per_position_tensor():
    """Every layer of a packed forward gets the same position_ids object: its sequence bounds
    (a device-to-host read on CUDA) are found once, and again only after an in-place change."""
    from samebits.trainer.registration import _packings

    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    first = _packings(pos)
    assert first[0].query_start_loc_cpu.tolist() == [0, 3, 5, 6]  # sequences (0, 3), (3, 5), (5, 6)
    assert first[0].query_lens.tolist() == [3, 2, 1] and first[0].block_table[1, :2].tolist() == [3, 4]
    assert _packings(pos) is first
    pos[0, 3:5] = torch.tensor([3, 4])  # now one sequence of 5 tokens, then one of 1
    assert _packings(pos)[0].query_start_loc_cpu.tolist() == [0, 5, 6]
    assert _packings(pos.clone())[0].query_start_loc_cpu.tolist() == [0, 5, 6]


def test_rotary_check_reads_the_buffer_once_until_it_changes(tiny, monkeypatch):
    """Each token_logprobs call checks the rotary (each RL micro-batch); a buffer that passed is
    not read again (on CUDA each read is a device sync) until it is written or replaced."""
    from samebits.trainer import logprobs

    m = trainer.load_hf_model(tiny, dtype=torch.bfloat16)
    reads = []
    real = logprobs._expected_inv_freq
    monkeypatch.setattr(logprobs, "_expected_inv_freq", lambda r: reads.append(1) or real(r))
    for _ in range(3):
        trainer.check_rotary_inv_freq(m)
    assert len(reads) == 1
    inv = m.model.rotary_emb.inv_freq
    inv.data = inv.clone()  # other storage, the same tensor object: read again
    trainer.check_rotary_inv_freq(m)
    assert len(reads) == 2
    inv[0] = inv[0] * 2  # written in place: read again, and refused
    with pytest.raises(trainer.RotaryMismatchError):
        trainer.check_rotary_inv_freq(m)


def test_positions_built_on_the_host_are_not_read_back_from_the_device():
    """token_logprobs builds the positions on the host: `remember_packings` reads the packing
    there, so the forward's attention never reads the device copy (on CUDA a sync a forward).
    A meta tensor stands in for the device copy: it has no values, so any read of it fails, as
    the control shows."""
    from samebits.trainer import registration

    host = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    device_copy = host.to("meta")
    with pytest.raises(NotImplementedError, match="meta"):  # the control: the forward reads the values
        registration._packings(host.to("meta"))
    registration.remember_packings(device_copy, host)
    (batch,) = registration._packings(device_copy)
    assert batch.query_start_loc_cpu.tolist() == [0, 3, 5, 9]


@pytest.mark.parametrize("profile", ["exact", "fast"])
@pytest.mark.parametrize("context_fn", [True, False])
def test_activation_checkpointing_recomputes_the_forwards_numerics(tiny, context_fn, profile):
    """transformers' gradient checkpointing (non-reentrant) recomputes each layer in backward,
    outside the forward's numerics context: with `trainer.checkpoint_context` the recompute
    re-enters it (batch_invariant() and the profile: the fast profile's CPU experts are another
    kernel with other bits), so the gradients are bit for bit those without checkpointing, also
    over a second backward through the retained graph (which recomputes again). The control,
    without it: in the exact profile the swapped modules recompute on transformers' path, save
    other tensors, and torch refuses the backward."""
    from torch.utils.checkpoint import CheckpointError

    from samebits.numerics.profile import PROFILES

    def run(checkpointing):
        m = trainer.load_hf_model(tiny, dtype=torch.float32).train()
        if checkpointing:
            kwargs = {"use_reentrant": False} | (
                {"context_fn": trainer.checkpoint_context} if context_fn else {}
            )
            if hasattr(m, "activation_checkpointing_enable"):  # transformers' name from 5.23 on
                m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        ids = torch.tensor([[5, 9, 11, 3, 7, 2, 8, 6, 4, 10]])
        with PROFILES[profile].context():
            pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
            logits = m(input_ids=ids, position_ids=pos, use_cache=False).logits
        loss = logits.square().mean()
        loss.backward(retain_graph=True)  # outside the context, as the RL update runs it
        first = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        loss.backward()  # a second backward recomputes again
        second = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        return logits.detach(), first, second

    want_logits, want, want_twice = run(False)
    if not context_fn:
        if profile == "exact":
            with pytest.raises(CheckpointError):
                run(True)
        return
    got_logits, got, got_twice = run(True)
    assert torch.equal(got_logits, want_logits) and got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) and torch.equal(got_twice[n], want_twice[n]) for n in want)


def test_token_logprobs_hands_the_forward_its_packing(tiny, monkeypatch):
    """token_logprobs reads each forward's packing from the positions it built on the host
    (`remember_packings`, once a forward), before the model would read it from the device."""
    from samebits.trainer import logprobs

    m = trainer.load_hf_model(tiny, dtype=torch.bfloat16)
    seen = []
    real = logprobs.remember_packings
    monkeypatch.setattr(
        logprobs, "remember_packings", lambda dev, host: seen.append(host.tolist()) or real(dev, host)
    )
    with batch_invariant():
        trainer.token_logprobs(m, [[1, 2, 3], [4, 5]], [1, 1], packed=True)
    assert seen == [[[0, 1, 2, 0, 1]]]


def test_checkpoint_context_re_enters_the_forwards_depth_and_profile_each_time():
    """What `checkpoint_context` captured at the forward (here: the fast profile, inside two
    batch_invariant() contexts) is what each recompute sees, on any thread, entered as often as
    backwards recompute; the thread's own state comes back after each."""
    import threading

    from samebits.numerics import scope
    from samebits.numerics.profile import FAST

    with FAST.context(), batch_invariant(), batch_invariant():
        _, recompute = trainer.checkpoint_context()
    assert (scope.invariant_depth(), scope.profile_name()) == (0, "exact")
    seen = []

    def recompute_here():
        with recompute:
            seen.append((scope.invariant_depth(), scope.profile_name()))
        seen.append((scope.invariant_depth(), scope.profile_name()))

    recompute_here()
    recompute_here()  # a second backward
    worker = threading.Thread(target=recompute_here)  # autograd's device thread, on CUDA
    worker.start()
    worker.join()
    assert seen == [(1, "fast"), (0, "exact")] * 3
