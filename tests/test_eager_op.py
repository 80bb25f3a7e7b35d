"""Eager calls of samebits' ops run the op's kernel directly, and only where that cannot differ
from the op (`numerics/eager_op.py`): the same bits as `torch.ops.samebits.*` for every op,
the op itself under a dispatch mode, fake tensors, a gradient with no autograd.Function, or
mixed devices."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from samebits.model import attention as attention_module
from samebits.model.attention import AttentionBatch
from samebits.numerics import ops
from samebits.numerics.batch_invariant import batch_invariant
from samebits.numerics.eager_op import EagerOp, direct_route
from samebits.numerics.profile import FAST


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, device="cpu", dtype=torch.bfloat16):
    return torch.randn(*shape, generator=_g(seed)).to(dtype).to(device)


def _calls(device: str = "cpu"):
    """Each exported EagerOp with arguments on `device`, at shapes the CUDA kernels take
    (powers of two, head dim 64): (name, the EagerOp, its op, args)."""
    t, h, e, k, i, heads, d = 5, 128, 8, 2, 64, 4, 64

    def r(*shape, seed):
        return _randn(*shape, seed=seed, device=device)

    x, w = r(t, h, seed=1), r(h, seed=2)
    q, kk = r(t, heads, d, seed=3), r(t, 2, d, seed=4)
    pos = torch.arange(t, device=device)[None]
    inv = ops.rotary_inv_freq(d, 1e6).to(device)
    cos, sin = ops.rotary_cos_sin(q, pos, inv, 1.0)
    index = torch.stack([torch.randperm(e, generator=_g(10 + j))[:k] for j in range(t)]).to(device)
    weights = torch.softmax(torch.randn(t, k, generator=_g(5)), -1).to(torch.bfloat16).to(device)
    gate_up, down = r(e, 2 * i, h, seed=6), r(e, h, i, seed=7)
    mask = torch.tensor([True, False, True, False, False], device=device)
    batch = AttentionBatch.packed([2, 3], device)
    fields = (batch.block_table, batch.query_start_loc, batch.query_lens, batch.seq_lens)
    sam = torch.ops.samebits
    return [
        ("rms_norm", ops.rms_norm, sam.rms_norm, (x, w, 1e-6)),
        ("add_rms_norm", ops.add_rms_norm, sam.add_rms_norm, (x, r(t, h, seed=8), w, 1e-6)),
        ("rotary_cos_sin", ops.rotary_cos_sin, sam.rotary_cos_sin, (q, pos, inv, 1.0)),
        ("mrope_cos_sin", ops.mrope_cos_sin, sam.mrope_cos_sin, (q, pos.expand(3, 1, t), inv, 1.0, [8, 12, 4])),
        ("apply_rotary", ops.apply_rotary, sam.apply_rotary, (q, kk, cos[0], sin[0], 1)),
        ("router", ops.router, sam.router, (r(t, e, seed=9), k, True)),
        ("deepstack_add", ops.deepstack_add, sam.deepstack_add, (x, mask, r(2, h, seed=11))),
        ("experts", ops.experts, sam.experts, (x, index, weights, gate_up, down)),
        (
            "paged_attention",
            attention_module._paged_attention,
            sam.paged_attention,
            (q, kk, kk, *fields, batch.max_query_len, 0.125, batch.block_size),
        ),
    ]


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _every_op_gives_the_ops_bits(device: str, where: str) -> None:
    context = {"plain": torch.no_grad, "batch_invariant": batch_invariant, "fast": FAST.context}[where]
    names = []
    for name, eager, op, args in _calls(device):
        assert isinstance(eager, EagerOp), name
        assert direct_route(args) == (device, False), name  # the call below takes the direct path
        with context():
            assert _equal(eager(*args), op(*args)), (name, where)
        names.append(name)
    assert len(names) == 9


@pytest.mark.parametrize("where", ["plain", "batch_invariant", "fast"])
def test_every_eager_op_gives_the_ops_bits(where):
    _every_op_gives_the_ops_bits("cpu", where)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["plain", "batch_invariant", "fast"])
def test_every_eager_op_gives_the_ops_bits_on_cuda(where):
    """The same on CUDA, where the kernels are Triton's (and the control below is the CPU's)."""
    _every_op_gives_the_ops_bits("cuda", where)


def test_a_kernel_map_naming_another_kernel_is_caught():
    """Control: the comparison above sees a direct kernel that is not the op's (the fast
    profile's experts, called where the op runs the exact one)."""
    from samebits.numerics.registry import pick

    _, _, op, args = next(c for c in _calls() if c[0] == "experts")
    wrong = EagerOp(op, lambda device: pick("experts", device, "fast"))
    assert not torch.equal(wrong(*args), op(*args))


class _Recorded:
    """An EagerOp over a recording op and kernel: which of the two ran."""

    def __init__(self, grad=None):
        self.ran: list[str] = []

        def op(x, y):
            self.ran.append("op")
            return x.clone()

        def kernel(device):
            self.ran.append(f"kernel:{device}")
            return self._below_autograd

        self.eager = EagerOp(op, kernel, grad=grad)

    def _below_autograd(self, x, y):
        """The kernel runs as the op runs it: autograd's dispatch keys excluded."""
        key = torch._C.DispatchKey.AutogradFunctionality
        self.ran.append(f"below autograd: {torch._C._dispatch_tls_is_dispatch_key_excluded(key)}")
        return x.clone()


def test_the_direct_path_is_taken_only_where_it_cannot_differ():
    x, y = torch.ones(3), torch.ones(3)
    r = _Recorded()
    r.eager(x, y)
    assert r.ran == ["kernel:cpu", "below autograd: True"]
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality)

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    r.ran.clear()
    with Passing():  # control: a dispatch mode is active, so the op runs
        r.eager(x, y)
    assert r.ran == ["op"]

    r.ran.clear()
    with FakeTensorMode() as mode:
        r.eager(mode.from_tensor(x), mode.from_tensor(y))  # fake tensors (a subclass): the op
    assert r.ran == ["op"]

    class Sub(torch.Tensor):
        pass

    r.ran.clear()
    r.eager(x.as_subclass(Sub), y)  # a tensor subclass, no mode active: the op
    r.eager(x, torch.ones(3, device="meta"))  # mixed devices: the op's dispatch decides
    r.eager(torch.ones(3, device="meta"), torch.ones(3, device="meta"))  # not a registry device
    r.eager(x, y=y)  # by keyword: the op binds the schema's names
    assert r.ran == ["op"] * 4

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    r.ran.clear()
    with Recording():  # a torch function mode (as `with torch.device(...)` is): the op
        r.eager(x, y)
    with torch.device("cpu"):
        r.eager(x, y)
    with warnings.catch_warnings():  # torch.jit.trace is deprecated, and still traces
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.trace(lambda a, b: r.eager(a, b), (x, y), check_trace=False)  # TorchScript: the op
    assert r.ran == ["op"] * 3

    r.ran.clear()
    leaf = torch.ones(3, requires_grad=True)
    r.eager(leaf, y)  # a gradient to record and no autograd.Function: the op (which refuses it)
    with torch.no_grad():
        r.eager(leaf, y)  # nothing recorded: direct
    assert r.ran == ["op", "kernel:cpu", "below autograd: True"]


def test_a_call_that_records_a_gradient_goes_through_grad():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return 2 * g, 2 * g

    r = _Recorded(grad=Double)
    leaf = torch.ones(3, requires_grad=True)
    r.eager(leaf, torch.ones(3)).sum().backward()
    assert r.ran == [] and torch.equal(leaf.grad, torch.full((3,), 2.0))


def _experts_gradients_are_the_ops(device: str, dtype: torch.dtype, other_backward) -> None:
    """`other_backward`: a context in which the op's backward formula is another one (the
    control: the comparison sees a backward that differs)."""
    _, _, op, (x, index, weights, gate_up, down) = next(c for c in _calls(device) if c[0] == "experts")
    grad = _randn(*x.shape, seed=12, device=device)

    def grads(fn):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (x, weights, gate_up, down)]
        with batch_invariant():
            out = fn(leaves[0], index, leaves[1], leaves[2], leaves[3])
        out.backward(grad.to(dtype))
        return [out.detach(), *(t.grad for t in leaves)]

    leaf = x.to(dtype).clone().requires_grad_()  # a copy: `to` returns x itself in its own dtype
    assert direct_route((leaf,)) == (device, True)
    assert type(ops.experts(leaf, index, weights, gate_up, down).grad_fn).__name__ == "_ExpertsGradBackward"
    got, want = grads(ops.experts), grads(op)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with other_backward():
        other = grads(op)
    assert torch.equal(other[0], want[0])  # the same forward,
    assert any(not torch.equal(a, b) for a, b in zip(got[1:], other[1:], strict=True))  # other gradients


def test_the_experts_gradients_are_the_ops():
    """`ops.experts` with autograd recording runs `_ExpertsGrad`; its output and gradients are
    those of the op's registered autograd, bit for bit (one forward kernel, one backward
    function), inside batch_invariant()."""
    _experts_gradients_are_the_ops("cpu", torch.float32, _recompute_backward("cpu"))


@pytest.mark.gpu
def test_the_experts_gradients_are_the_ops_on_cuda():
    """The same on CUDA: the Triton forward, the closed-form backward routed by `route_pairs`."""
    _experts_gradients_are_the_ops("cuda", torch.bfloat16, _recompute_backward("cuda"))


def _recompute_backward(device: str):
    """A context in which the experts' backward on `device` is autograd through the stock
    grouped_mm twin (not the registry's formula)."""
    import contextlib

    from samebits.kernels.experts import experts_grouped_mm
    from samebits.numerics import registry

    @contextlib.contextmanager
    def swapped():
        table = registry.TABLE["experts_backward"][device]
        saved = dict(table)
        table.clear()
        table[registry.ANY] = registry._grads_by_recompute(experts_grouped_mm, invariant=False)
        try:
            yield
        finally:
            table.clear()
            table.update(saved)

    return swapped


def test_kernels_are_registered_on_the_op_not_the_eager_op():
    with pytest.raises(AttributeError, match="registry"):
        ops.rms_norm.register_kernel("cuda")
    assert callable(ops.rms_norm.register_fake)  # the rest is the op's


def test_torch_compile_sees_the_op():
    """Traced by torch.compile, the exported name is the opaque op (nothing fuses into it or
    reorders it); the compiled call gives the eager call's bits."""
    from torch._dynamo.testing import CompileCounterWithBackend

    name, eager, op, args = _calls()[0]
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lambda *a: eager(*a) * 2, backend=counter, fullgraph=True)
    assert torch.equal(compiled(*args), eager(*args) * 2)
    targets = [n.target for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.samebits.rms_norm.default in targets, targets
