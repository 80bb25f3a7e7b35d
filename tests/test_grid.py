"""`kernels.grid`: the host twins of `triton.cdiv` and `triton.next_power_of_2` give their results
(the launchers size grids and blocks by them: a different answer would change a launch)."""

from __future__ import annotations

import importlib.util

import pytest

from samebits.kernels.grid import cdiv, next_power_of_2

SIZES = [*range(0, 5000), 2**16 - 1, 2**16, 2**16 + 1, 151936, 2**31 - 1, 2**31, 2**40 + 3]


def test_next_power_of_2_is_the_smallest_power_of_2_not_below_n():
    assert next_power_of_2(0) == 0  # as Triton's bit trick gives
    for n in SIZES[1:]:
        p = next_power_of_2(n)
        assert p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n), n
    assert [next_power_of_2(n) for n in (1, 2, 3, 96, 128, 129, 2048)] == [1, 2, 4, 128, 128, 256, 2048]


def test_cdiv_is_the_ceiling_of_the_quotient():
    for x in SIZES:
        for y in (1, 2, 3, 16, 64, 100, 128, 4096):
            q = cdiv(x, y)
            assert q * y >= x and (q - 1) * y < x, (x, y)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_twins_agree_with_triton():
    import triton

    for n in SIZES:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for y in (1, 3, 64, 4096):
            assert cdiv(n, y) == triton.cdiv(n, y), (n, y)
