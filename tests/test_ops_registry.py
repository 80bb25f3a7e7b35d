"""The ops registry: one table picks each op's implementation per device and profile; the
profile is a per-thread context, not a model attribute; kernels import nothing above them."""

from __future__ import annotations

import ast
import inspect
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from samebits.kernels.experts import experts_ref, experts_stock_ref
from samebits.model.qwen3_moe import model as qwen3_moe
from samebits.numerics import ops, registry
from samebits.numerics.batch_invariant import batch_invariant
from samebits.numerics.profile import EXACT, FAST

SRC = Path(__file__).resolve().parents[1] / "src" / "samebits"


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _experts_inputs(dtype=torch.bfloat16, t=23, e=6, k=2, h=40, i=24):
    gu = (0.1 * torch.randn(e, 2 * i, h, generator=_g(1))).to(dtype)
    dn = (0.1 * torch.randn(e, h, i, generator=_g(2))).to(dtype)
    x = torch.randn(t, h, generator=_g(3)).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=_g(10 + j))[:k] for j in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=_g(4)), -1).to(dtype)
    return x, idx, w, gu, dn


def test_the_profile_context_picks_the_experts_implementation():
    args = _experts_inputs()
    exact, fast = experts_ref(*args), experts_stock_ref(*args)
    assert not torch.equal(exact, fast)  # control: the two implementations differ in the bits
    assert torch.equal(ops.experts(*args), exact)  # no context: the exact profile
    with EXACT.context():
        assert torch.equal(ops.experts(*args), exact)
    with FAST.context():
        assert torch.equal(ops.experts(*args), fast)
        with EXACT.context():  # nested: the innermost profile wins
            assert torch.equal(ops.experts(*args), exact)


def test_the_profile_is_per_thread():
    args = _experts_inputs()
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def other():
        inside.wait(timeout=60)
        seen["out"] = ops.experts(*args)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with FAST.context():
        inside.set()
        assert done.wait(timeout=60)
    t.join(timeout=60)
    assert torch.equal(seen["out"], experts_ref(*args))


def test_experts_backward_gives_the_differentiable_exact_formulas_bits():
    """The op's backward recomputes `experts_ref` through F.linear inside batch_invariant(): the
    gradients are those of autograd through that formula, bit for bit (the CPU path before the op)."""
    x, idx, w, gu, dn = (t.float() for t in _experts_inputs())
    idx = idx.long()
    grad = torch.randn(x.shape, generator=_g(5))

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
        fn(leaves[0], idx, leaves[1], leaves[2], leaves[3]).backward(grad)
        return [t.grad for t in leaves]

    def formula(a, i, b, c, d):
        with batch_invariant():
            return experts_ref(a, i, b, c, d, linear=F.linear)

    got, want = grads(ops.experts), grads(formula)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    stock = grads(experts_stock_ref)  # control: another formula's gradients differ
    assert any(not torch.equal(a, b) for a, b in zip(got, stock, strict=True))


def test_every_op_has_an_implementation_for_every_device_and_profile():
    for op in registry.TABLE:
        for device in registry.DEVICES:
            for profile in ("exact", "fast"):
                assert callable(registry.pick(op, device, profile)), (op, device, profile)


def test_model_constructors_take_the_config_and_nothing_else():
    classes = [
        qwen3_moe.Experts,
        qwen3_moe.SparseMoeBlock,
        qwen3_moe.Qwen3MoeModel,
        qwen3_moe.Qwen3MoeForCausalLM,
    ]
    for cls in classes:
        assert list(inspect.signature(cls).parameters) == ["cfg"], cls
    assert list(inspect.signature(qwen3_moe.DecoderLayer).parameters) == ["cfg", "layer_idx"]
    model = qwen3_moe.Qwen3MoeForCausalLM.__init__
    assert "profile" not in inspect.getsource(model)


def _imports(path: Path) -> set[str]:
    """Every samebits module a file imports (module level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("samebits"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("samebits")}
    return names


def test_kernels_import_nothing_above_them_and_numerics_has_no_cycle():
    for path in (SRC / "kernels").glob("*.py"):
        upward = {m for m in _imports(path) if not m.startswith("samebits.kernels")}
        assert not upward, f"{path.name} imports {upward}"
    graph = {}
    for layer in ("kernels", "numerics"):
        for path in (SRC / layer).glob("*.py"):
            graph[f"samebits.{layer}.{path.stem}"] = {m for m in _imports(path) if m.count(".") == 2}
    done, visiting = set(), []

    def visit(mod):
        assert mod not in visiting, f"import cycle: {' -> '.join([*visiting, mod])}"
        if mod in done or mod not in graph:
            return
        visiting.append(mod)
        for dep in graph[mod]:
            visit(dep)
        visiting.pop()
        done.add(mod)

    for mod in graph:
        visit(mod)


def test_no_device_branch_outside_the_registry():
    """`is_cuda` appears in kernels/ only as an input check of a CUDA launcher."""
    for path in [
        *(SRC / "numerics").glob("*.py"),
        SRC / "kernels" / "experts.py",
        SRC / "kernels" / "reduce.py",
    ]:
        if path.name != "registry.py":
            assert ".is_cuda" not in path.read_text(), path.name


def test_set_numerics_switches_the_profile_through_the_public_api(tiny):
    from samebits import LLM, SamplingParams
    from samebits.verify import make_prompts

    llm = LLM(tiny, max_num_seqs=4, max_model_len=96)
    prompts = make_prompts((30, 5, 47, 12), llm.config.vocab_size, seed=3)
    greedy = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * len(prompts)
    exact = llm.generate(prompts, greedy)
    llm.set_numerics("fast")
    fast = llm.generate(prompts, greedy)
    # the fast profile runs other kernels: other log-prob bits (the first token: same prefix)
    assert any(not torch.equal(a.logprobs[:1], b.logprobs[:1]) for a, b in zip(exact, fast, strict=True))
    llm.set_numerics("exact")
    again = llm.generate(prompts, greedy)
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(exact, again, strict=True))
    with pytest.raises(ValueError, match="numerics must be one of"):
        llm.set_numerics("quick")


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="the control is MKL's N-dependent blocking")
def test_the_cpu_keeps_adjacent_projections_as_separate_gemms():
    """q/k/v lying back to back (the loader's layout) stay three GEMMs on the CPU, each with the
    bits it has alone. Control, the reason: MKL picks its blocking by N, so one GEMM over the
    joined weights gives some columns other bits: measured at the real width in bf16 (q 512, k
    and v 64 rows of K = 2048) on AVX-512 CPUs, and on AVX2-only ones in fp32 where k and v are
    narrower (8 rows; rounded to bf16 the difference vanished there); the control holds where
    either shows it."""
    differs = []
    for q, kv, dtype in ((512, 64, torch.bfloat16), (16, 8, torch.float32)):
        buf = (torch.randn(q + 2 * kv, 2048, generator=_g(5)) * 2048**-0.5).to(dtype)
        weights = [buf[:q], buf[q : q + kv], buf[q + kv :]]
        x = torch.randn(16, 2048, generator=_g(6)).to(dtype)
        with EXACT.context():
            got = ops.projections(x, weights)
            alone = [F.linear(x, w) for w in weights]
            joined = F.linear(x, buf).split([q, kv, kv], dim=-1)
        assert all(torch.equal(a, b) for a, b in zip(got, alone, strict=True))
        differs.append(not all(torch.equal(a, b) for a, b in zip(joined, alone, strict=True)))
    assert any(differs)


def test_slot_add_rms_norm_is_the_experts_sum_then_add_rms_norm():
    """`ops.slot_add_rms_norm` (a MoE layer's slot outputs summed in the next norm) gives
    `add_rms_norm` of the experts' own output, at the real width (K 8, H 2048). Control, the
    reason: the slots summed in another order (aten's sum over K) give other bits."""
    big = 1e5 * torch.randn(5, 4, 2048, generator=_g(11))
    # slots k and k + 4 nearly cancel: the halving tree adds them first, a sum in index order
    # carries the large partial sums, so the two orders differ visibly after rounding
    slots = torch.cat([big, -big + torch.randn(5, 4, 2048, generator=_g(12))], dim=1)
    residual = torch.randn(5, 2048, generator=_g(13)).bfloat16()
    weight = (1 + 0.1 * torch.randn(2048, generator=_g(14))).bfloat16()
    index_order = slots.sum(1).bfloat16()  # outside batch_invariant(): aten's own sum
    with EXACT.context():
        got = ops.slot_add_rms_norm(slots, residual, weight, 1e-6)
        want = ops.add_rms_norm(ops.sum_slots(slots, torch.bfloat16), residual, weight, 1e-6)
        other = ops.add_rms_norm(index_order, residual, weight, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not torch.equal(other[0], want[0])


def test_the_exact_cpu_model_sums_its_moe_slots_in_the_next_norm(tiny, monkeypatch):
    """On the CPU the exact profile's MoE blocks hand the next norm their slot outputs
    (`Slots`): every sparse layer's sum goes through `slot_add_rms_norm`, and a layer's block
    output is the experts op's bit for bit. The fast profile (stock experts) has no such step."""
    from samebits.model.qwen3_moe.config import ModelConfig

    cfg = ModelConfig.from_pretrained(tiny)
    block = qwen3_moe.SparseMoeBlock(cfg)
    with torch.no_grad():
        for i, p in enumerate(block.parameters()):
            p.copy_(0.1 * torch.randn(p.shape, generator=_g(20 + i)))
    block = block.bfloat16()
    x = torch.randn(6, cfg.hidden_size, generator=_g(15)).bfloat16()
    with torch.no_grad(), EXACT.context():
        out = block.forward_slots(x)
        weights, index = block.gate(x)
        want = ops.experts(x, index, weights, block.experts.gate_up_proj, block.experts.down_proj)
    assert isinstance(out, qwen3_moe.Slots) and torch.equal(out.summed(), want)
    with torch.no_grad(), FAST.context():
        assert not isinstance(block.forward_slots(x), qwen3_moe.Slots)
