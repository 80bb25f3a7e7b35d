"""Row-invariant implementations of the aten ops `batch_invariant()` covers, per device.

`covered(device)` binds them to that device's kernels from the registry (`matmul`, `bmm`,
`tree_sum`). Each reduces in a fixed order per output element, so an element's bits depend
on its own inputs and the reduced sizes, never on how many other rows share the call. A
function returns `NotImplemented` where the stock kernel is exact anyway (integer sums).
GEMMs inside (convolution, sdpa, mv) go through `torch.mm`/`torch.matmul`, which the same
overrides route to the row-invariant matmul.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from samebits.kernels.softmax import softmax_ref
from samebits.numerics import registry

_LOW = (torch.bfloat16, torch.float16)
# set while a covered GEMM runs: `matmul_ref` itself multiplies with `torch.mm(..., out=)`,
# which must then reach the stock kernel, not the `mm.out` override again
_in_gemm = threading.local()


def _dims(x: torch.Tensor, dim) -> list[int]:
    """aten's reduced dims: None or [] means every dim."""
    if dim is None or len(dim) == 0:
        return list(range(x.dim()))
    return sorted({d % max(x.dim(), 1) for d in dim})


def _flat(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """x with `dims` moved last and flattened into one: [kept..., reduced]."""
    keep = [d for d in range(x.dim()) if d not in dims]
    return x.permute(*keep, *dims).reshape(*[x.shape[d] for d in keep], -1)


def _unflat(out: torch.Tensor, x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    if not keepdim:
        return out
    return out.reshape([1 if d in dims else x.shape[d] for d in range(x.dim())])


class Covered:
    """The covered ops on one device (see the table in `batch_invariant`)."""

    def __init__(self, device: str):
        self.matmul = registry.pick("matmul", device, registry.ANY)
        self.bmm_kernel = registry.pick("bmm", device, registry.ANY)
        self.tree = registry.pick("tree_sum", device, registry.ANY)
        self.log_softmax = registry.pick("log_softmax", device, registry.ANY)
        self.device = device

    # -- GEMMs ----------------------------------------------------------------------------------

    def mm(self, a, b):
        return self.matmul(a, b)

    def addmm(self, bias, a, b, *, beta=1, alpha=1):
        if beta != 1 or alpha != 1:
            raise NotImplementedError("samebits batch_invariant addmm supports only alpha=beta=1")
        if self.device == "cuda" and not (bias.dim() == 1 and bias.shape[0] == b.shape[1]):
            # the Triton kernel adds a [N] bias only; other biases: fp32 GEMM, fp32 add, one rounding
            return (self.matmul(a.float(), b.float()) + bias.float()).to(a.dtype)
        return self.matmul(a, b, bias)

    def bmm(self, a, b):
        return self.bmm_kernel(a, b)

    # GEMMs into a given tensor (`out=`, in place, `out_dtype=`): TRL's fused-head tiles
    # (`torch.mm(..., out=tile)`) and its backward's fp32 accumulations (`addmm(..., out=acc)`)

    def _into(self, out, gemm, *args, **kwargs):
        if getattr(_in_gemm, "on", False):
            return NotImplemented  # matmul_ref's own stock `mm(out=)`
        _in_gemm.on = True
        try:
            result = gemm(*args, **kwargs)
        finally:
            _in_gemm.on = False
        if out.shape != result.shape:
            out.resize_(result.shape)
        return out.copy_(result)

    def mm_out(self, a, b, *, out):
        return self._into(out, self.matmul, a, b)

    def mm_dtype(self, a, b, out_dtype):
        return self.matmul(a.to(out_dtype), b.to(out_dtype))

    def mm_dtype_out(self, a, b, out_dtype, *, out):
        return self._into(out, self.mm_dtype, a, b, out_dtype)

    def addmm_out(self, bias, a, b, *, beta=1, alpha=1, out):
        return self._into(out, self.addmm, bias, a, b, beta=beta, alpha=alpha)

    def addmm_inplace(self, bias, a, b, *, beta=1, alpha=1):
        return self._into(bias, self.addmm, bias, a, b, beta=beta, alpha=alpha)

    def addmm_dtype(self, bias, a, b, out_dtype, *, beta=1, alpha=1):
        """`addmm(..., out_dtype=)` (bf16 inputs, fp32 result): the GEMM of the widened inputs."""
        return self.addmm(bias.to(out_dtype), a.to(out_dtype), b.to(out_dtype), beta=beta, alpha=alpha)

    def addmm_dtype_out(self, bias, a, b, out_dtype, *, beta=1, alpha=1, out):
        return self._into(out, self.addmm_dtype, bias, a, b, out_dtype, beta=beta, alpha=alpha)

    def mv(self, a, v):
        return torch.mm(a, v[:, None])[:, 0]

    def dot(self, a, b):
        return torch.mm(a[None], b[:, None])[0, 0]

    # -- reductions -----------------------------------------------------------------------------

    def _tree(self, x, dims):
        """Fixed-order sum of x over dims (flattened), in x's dtype -> the kept dims."""
        if len(dims) == 1:
            return self.tree(x, dims[0], False)
        return self.tree(_flat(x, dims), -1, False)

    def sum_dim(self, x, dim, keepdim=False, *, dtype=None):
        if x.dim() == 0 or not x.is_floating_point() or (dtype is not None and not dtype.is_floating_point):
            return NotImplemented  # integer and bool sums are exact in any order
        acc = x.to(dtype) if dtype is not None else x
        xf = acc.float() if acc.dtype in _LOW else acc
        dims = _dims(x, dim)
        if len(dims) == 1:  # one dim: the tree keeps the dim itself
            return self.tree(xf, dims[0], keepdim).to(acc.dtype)
        return _unflat(self._tree(xf, dims), x, dims, keepdim).to(acc.dtype)

    def mean_dim(self, x, dim, keepdim=False, *, dtype=None):
        if x.dim() == 0 or not x.is_floating_point():
            return NotImplemented  # a scalar's mean is itself; aten refuses integer means itself
        acc = x.to(dtype) if dtype is not None else x
        xf = acc.float() if acc.dtype in _LOW else acc
        dims = _dims(x, dim)
        if len(dims) == 1:
            n = xf.shape[dims[0]]
            return (self.tree(xf, dims[0], keepdim) / n).to(acc.dtype)
        n = math.prod(x.shape[d] for d in dims)
        return (_unflat(self._tree(xf, dims), x, dims, keepdim) / n).to(acc.dtype)

    def _log_softmax(self, x, dim, half_to_float):
        return self.log_softmax(x, dim, torch.float32 if half_to_float else x.dtype, self.tree)

    def _softmax(self, x, dim, half_to_float):
        return softmax_ref(x, dim, torch.float32 if half_to_float else x.dtype, self.tree)

    def logsumexp(self, x, dim, keepdim=False):
        if not x.is_floating_point():
            return NotImplemented
        dims = _dims(x, dim)
        xf = x.float() if x.dtype in _LOW else x
        m = torch.amax(xf, dims, keepdim=True)
        m = m.masked_fill(m.abs() == math.inf, 0)  # aten's rule: an infinite max shifts by 0
        kept = [x.shape[d] for d in range(x.dim()) if d not in dims]
        out = self._tree((xf - m).exp(), dims).log() + m.reshape(kept)
        return _unflat(out, x, dims, keepdim).to(x.dtype)

    def _var(self, x, dim, correction, keepdim):
        """-> (var, mean) in x's dtype: two passes, each a fixed-order tree."""
        dims = _dims(x, dim)
        xf = x.float() if x.dtype in _LOW else x
        n = math.prod(x.shape[d] for d in dims)
        mean = _unflat(self._tree(xf, dims) / n, x, dims, True)
        c = 1 if correction is None else correction
        var = self._tree((xf - mean) ** 2, dims) / max(0, n - c)
        return _unflat(var, x, dims, keepdim).to(x.dtype), _unflat(mean, x, dims, keepdim).to(x.dtype)

    def var(self, x, dim=None, *, correction=None, keepdim=False):
        return self._var(x, dim, correction, keepdim)[0]

    def var_mean(self, x, dim=None, *, correction=None, keepdim=False):
        return self._var(x, dim, correction, keepdim)

    def std(self, x, dim=None, *, correction=None, keepdim=False):
        return self._var(x, dim, correction, keepdim)[0].sqrt()

    def std_mean(self, x, dim=None, *, correction=None, keepdim=False):
        var, mean = self._var(x, dim, correction, keepdim)
        return var.sqrt(), mean

    def native_layer_norm(self, x, normalized_shape, weight, bias, eps):
        """Mean and variance by trees over the normalized dims, fp32, one rounding of the output."""
        axis = x.dim() - len(normalized_shape)
        dims = list(range(axis, x.dim()))
        xf = x.float()
        n = math.prod(normalized_shape)
        mean = _unflat(self._tree(xf, dims) / n, x, dims, True)
        var = _unflat(self._tree((xf - mean) ** 2, dims) / n, x, dims, True)
        rstd = torch.rsqrt(var + eps)
        y = (xf - mean) * rstd
        if weight is not None:
            y = y * weight.float()
        if bias is not None:
            y = y + bias.float()
        # mean/rstd in the dtype aten returns them (autograd's backward reads them)
        mixed = x.dtype in _LOW and weight is not None and weight.dtype == torch.float32
        stat = torch.float32 if (self.device == "cuda" and x.dtype in _LOW) or mixed else x.dtype
        return y.to(x.dtype), mean.to(stat), rstd.to(stat)

    # -- convolution and attention ----------------------------------------------------------------

    def convolution(self, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
        """im2col, then one row-invariant GEMM per group: an output position is a row [C*k]."""
        if transposed:
            raise NotImplementedError(
                "batch_invariant(): transposed convolution has no row-invariant implementation; "
                "run it outside batch_invariant()"
            )
        spatial = weight.dim() - 2
        pad = [p for q in reversed(padding) for p in (q, q)]
        cols = F.pad(x, pad) if any(pad) else x  # [N, C, *S]
        for i in range(spatial):
            k = weight.shape[2 + i]
            cols = cols.unfold(2 + i, dilation[i] * (k - 1) + 1, stride[i])[..., :: dilation[i]]
        out_shape = cols.shape[2 : 2 + spatial]  # [N, C, *O, *k]
        perm = [0, *range(2, 2 + spatial), 1, *range(2 + spatial, 2 + 2 * spatial)]
        cols = cols.permute(perm)  # [N, *O, C, *k]
        c_in = weight.shape[1]
        outs = []
        for g in range(groups):
            a = cols[..., g * c_in : (g + 1) * c_in, *([slice(None)] * spatial)].reshape(-1, weight[0].numel())
            w = weight[g * weight.shape[0] // groups : (g + 1) * weight.shape[0] // groups]
            b = None if bias is None else bias[g * w.shape[0] : (g + 1) * w.shape[0]]
            w2 = w.reshape(w.shape[0], -1).t()
            outs.append(torch.mm(a, w2) if b is None else torch.addmm(b, a, w2))
        y = torch.cat(outs, dim=-1) if groups > 1 else outs[0]  # [N * prod(O), out]
        y = y.reshape(x.shape[0], *out_shape, weight.shape[0])
        return y.permute(0, -1, *range(1, 1 + spatial)).contiguous()

    def sdpa_flash_cpu(self, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        """sdpa's CPU fused kernel as the math path on the covered ops -> (out [B,H,L,E], lse [B,H,L])."""
        if dropout_p:
            raise NotImplementedError("batch_invariant(): sdpa with dropout; set dropout_p=0")
        if k.shape[-3] != q.shape[-3]:  # grouped-query attention
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        s = torch.matmul(q, k.transpose(-2, -1)).float() * (scale or q.shape[-1] ** -0.5)
        if is_causal:
            keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, -math.inf)
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else s + attn_mask.float()
        lse = torch.logsumexp(s, -1)
        out = torch.matmul(torch.softmax(s, -1).to(v.dtype), v)
        # the fused kernel's layouts: out [B, L, H, E] and lse [B, L, H] in memory
        return out.transpose(1, 2).contiguous().transpose(1, 2), lse.transpose(1, 2).contiguous().transpose(
            1, 2
        )


def covered(device: str) -> dict[str, object]:
    """aten overload -> its row-invariant implementation on `device` ("cpu" or "cuda")."""
    c = Covered(device)
    ops = {
        "mm": c.mm,
        "mm.out": c.mm_out,
        "addmm": c.addmm,
        "addmm.out": c.addmm_out,
        "addmm_": c.addmm_inplace,
        "bmm": c.bmm,
        "mv": c.mv,
        "dot": c.dot,
        "_log_softmax": c._log_softmax,
        "_softmax": c._softmax,
        "sum.dim_IntList": c.sum_dim,
        "mean.dim": c.mean_dim,
        "logsumexp": c.logsumexp,
        "var.correction": c.var,
        "var_mean.correction": c.var_mean,
        "std.correction": c.std,
        "std_mean.correction": c.std_mean,
        "native_layer_norm": c.native_layer_norm,
        "convolution": c.convolution,
    }
    if device == "cpu":
        ops["_scaled_dot_product_flash_attention_for_cpu"] = c.sdpa_flash_cpu
    else:  # `out_dtype=` GEMMs exist on CUDA only
        ops |= {
            "mm.dtype": c.mm_dtype,
            "mm.dtype_out": c.mm_dtype_out,
            "addmm.dtype": c.addmm_dtype,
            "addmm.dtype_out": c.addmm_dtype_out,
        }
    return ops
