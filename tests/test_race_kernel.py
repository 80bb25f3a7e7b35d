"""The exponential race over given probabilities in one launch (`sample_launch.race`, the
sampler's rows with banned tokens, top-k/top-p or top log-probs): the op-by-op race's bits
(`kernels.sample.race`), in Triton's CPU interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch


def rows(vocab: int, n: int, seed: int, device: str, pad: int = 0) -> tuple[torch.Tensor, ...]:
    """(lps, probs, scores, keys, random_row) on `device` with the cases the race must get
    right: narrowed zeros, a first NaN, a row with nothing left, the last id, greedy rows, and
    (row 6) a tie of two ids in two blocks, made with the device's own noise and division.
    `pad` > 0: probs is a view of rows `pad` ids longer (a row stride other than V)."""
    from samebits.kernels.sample import exponential_noise
    from samebits.kernels.sample_triton import RACE_BLOCK

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    lps = torch.log_softmax(logits, dim=-1)
    full = torch.zeros(n, vocab + pad)
    probs = full[:, :vocab]
    probs.copy_(lps.exp())
    probs[0, : vocab // 2] = 0.0  # narrowed away
    probs[1, 5], probs[1, vocab - 3] = float("nan"), float("nan")  # the first NaN wins, as in argmax
    probs[2] = 0.0  # nothing left: the best score
    probs[3] = 0.0
    probs[3, vocab - 1] = 1.0  # only the last id, in the last (partial) block
    keys = torch.randint(0, 2**32, (n, 2), generator=g, dtype=torch.int64)
    random_row = torch.tensor([i % 5 != 4 for i in range(n)])  # every 5th row greedy
    lps, logits, keys, random_row = (t.to(device) for t in (lps, logits, keys, random_row))
    probs = full.to(device)[:, :vocab]
    if vocab > RACE_BLOCK + 7 and n > 6:  # ids 7 and RACE_BLOCK + 7 race the same ratio
        a, b = 7, RACE_BLOCK + 7
        noise = exponential_noise(keys[6:7], vocab)[0]
        probs[6] = 0.0
        probs[6, a] = 0.5
        target = probs[6, a] / noise[a]
        pb = (target * noise[b]).reshape(1)
        up, down = torch.ones(1, device=device), torch.zeros(1, device=device)
        for _ in range(64):  # step p_b by ulps until p_b / n_b rounds to the same ratio
            if pb / noise[b] == target:
                break
            pb = torch.nextafter(pb, up if pb / noise[b] < target else down)
        assert pb / noise[b] == target
        probs[6, b] = pb[0]
    return lps, probs, logits, keys, random_row


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def check(device: str) -> None:
    from samebits.kernels import sample, sample_launch, sample_triton

    block = sample_triton.RACE_BLOCK
    for vocab, n, pad in ((20_000, 9, 0), (151_936, 7, 0), (100, 5, 0), (2 * block, 7, 0), (20_000, 9, 77)):
        lps, probs, scores, keys, random_row = rows(vocab, n, vocab, device, pad)
        assert probs.stride(0) == vocab + pad
        want = sample.race(lps, probs, scores, keys, random_row)
        got = sample_launch.race(lps, probs, scores, keys, random_row)
        assert torch.equal(got[0], want[0]), (vocab, got[0], want[0])
        assert torch.equal(_bits(got[1]), _bits(want[1]))  # every bit, NaNs too
        assert want[0][1] == 5 and want[0][3] == vocab - 1
        if vocab > block + 7:
            assert want[0][6] == 7  # the lower id of the tie
            # control: the same partials combined so that the later block wins a tie
            pr = -(-vocab // block)
            val = torch.empty(n, pr, device=device)
            idx, pos = (torch.empty(n, pr, dtype=torch.int32, device=device) for _ in range(2))
            sample_triton._race_probs_kernel[(n, pr)](
                probs, probs.stride(0), vocab, keys, val, idx, pos, PR=pr, BLOCK=block, enable_fp_fusion=False
            )
            later = pr - 1 - torch.argmax(val.flip(1), dim=1)
            assert idx[6, later[6]] == block + 7


class _NumpyLog:
    """`torch` for `kernels.sample` with numpy's float32 log: the interpreter's `tl.log`."""

    def log(self, t):
        import numpy as np

        return torch.from_numpy(np.log(t.numpy()))

    def __getattr__(self, name):
        return getattr(torch, name)


_INTERPRETED = """
import sys
sys.path.insert(0, "tests")
import test_race_kernel
from samebits.kernels import sample
sample.torch = test_race_kernel._NumpyLog()
test_race_kernel.check("cpu")
print("OK")
"""


def test_race_kernel_is_the_op_by_op_race_in_the_interpreter():
    """Blocks of RACE_BLOCK ids and their partials, the lowest id of a tie across blocks, the
    first NaN, a row with nothing left (the best score), greedy rows, vocabularies below one
    block and at whole blocks: tokens and log-probs equal to `kernels.sample.race`'s (its log
    made numpy's, the interpreter's). Control: the same partials combined so that the later
    block wins a tie pick the other id."""
    from interpreted import run_interpreted

    run_interpreted(_INTERPRETED, timeout=600)


@pytest.mark.gpu
def test_race_kernel_is_the_op_by_op_race_on_cuda(monkeypatch):
    """As above with torch's own CUDA log, division and argmax, and the registry's CUDA `race`
    (the sampler's) runs the kernel."""
    from samebits.numerics import ops, registry

    check("cuda")
    calls = []
    fused = registry._FUSED_RACE
    monkeypatch.setattr(registry, "_FUSED_RACE", lambda *a: calls.append(1) or fused(*a))
    ops.race(*rows(151_936, 4, 1, "cuda"))
    assert calls == [1]
