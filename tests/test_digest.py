"""The fast weight digest (`samebits.engine.digest`): a pure-Python reference gives the same
lanes, the chunking does not change it, one flipped bit anywhere always changes it, and
`samebits rl` digests both sides with the kind it was given."""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import asdict

import pytest
import torch

from samebits import rl
from samebits.cli import main
from samebits.engine import digest
from samebits.engine.digest import (
    DIGEST_KINDS,
    LANES,
    MASK64,
    _byte_pieces,
    _word_chunks,
    fast_digest,
    fast_lanes,
    sha256_digest,
    tensor_digest,
)
from samebits.rl import checkpoint
from samebits.rl.loop import RLLoop


def _ref_lanes(t: torch.Tensor) -> list[int]:
    """The module docstring's formula in Python ints mod 2**64: no torch arithmetic."""
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    data += b"\0" * (-len(data) % 8)
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]

    def shr_xor(z, s):
        return z ^ (z >> s)

    out = []
    for a, s, m1, m2 in LANES:
        acc = 0
        for i, w in enumerate(words):
            z = w ^ ((i * a + s) & MASK64)
            z = (shr_xor(z, 30) * m1) & MASK64
            z = (shr_xor(z, 27) * m2) & MASK64
            acc = (acc + shr_xor(z, 31)) & MASK64
        out.append(acc)
    return out


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(37, 9, generator=g).bfloat16(),  # 666 bytes: a padded tail
        "fp32": torch.randn(41, generator=g),
        "int32": torch.randint(-(2**31), 2**31 - 1, (13,), dtype=torch.int32, generator=g),
        "int64": torch.randint(-(2**62), 2**62, (7,), generator=g) * 2 - 1,  # top bits set
        "uint8_odd": torch.randint(0, 256, (11,), dtype=torch.uint8, generator=g),
        "bool": torch.rand(9, generator=g) > 0.5,
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize("name", list(_tensors()))
def test_lanes_equal_the_pure_python_reference(name):
    t = _tensors()[name]
    assert fast_lanes(t) == _ref_lanes(t)
    assert fast_lanes(t, chunk_bytes=16) == _ref_lanes(t)


def test_the_reference_sees_the_index_and_the_lanes_differ():
    # control for the reference test: equal words at different indices mix differently
    t = torch.full((4,), 7, dtype=torch.int64)
    lanes = _ref_lanes(t)
    assert len(set(lanes)) == 4 and lanes != _ref_lanes(torch.full((1,), 7, dtype=torch.int64)) * 4


def _chunk_count(t, chunk_bytes) -> int:
    return len(list(_word_chunks(_byte_pieces(t, chunk_bytes))))


@pytest.mark.parametrize("strided", [False, True])
def test_chunking_does_not_change_the_digest(strided):
    t = torch.randn(300, 70).bfloat16()
    if strided:
        t = t.t()[::3]  # [24, 300], strides (3, 70): not contiguous
    sizes = (16, 24, 40, 1000, 8 * 1024, 2**20)
    # the chunkings really differ (1 to thousands of partial sums), which is what is claimed
    counts = [_chunk_count(t, c) for c in sizes]
    assert len(set(counts)) == len(sizes) and counts[-1] == 1, counts
    assert len({fast_digest(t, chunk_bytes=c) for c in sizes}) == 1


def test_a_view_at_an_unaligned_address_is_read_from_its_own_first_byte():
    x = torch.randn(101).bfloat16()
    v = x[1:]  # contiguous, 2 bytes past an 8-byte boundary: its words are copied first
    assert v.is_contiguous() and v.data_ptr() % 8 == 2
    assert fast_lanes(v) == _ref_lanes(v.clone()) != fast_lanes(x[:-1])


def test_pieces_stay_within_the_chunk_and_cover_the_logical_bytes():
    t = torch.arange(5 * 7 * 3, dtype=torch.float32).reshape(5, 7, 3).permute(2, 0, 1)
    pieces = list(_byte_pieces(t, 24))
    assert max(p.numel() for p in pieces) <= 24
    assert torch.equal(torch.cat(pieces), t.contiguous().reshape(-1).view(torch.uint8))


def _flip(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    u = t.clone()
    u.reshape(-1).view(torch.uint8)[byte] ^= 1 << bit
    return u


@pytest.mark.parametrize("name", ["bf16", "fp32", "uint8_odd", "int64", "scalar"])
def test_one_flipped_bit_anywhere_changes_every_lane(name):
    t = _tensors()[name]
    n = t.numel() * t.element_size()
    base = fast_lanes(t)
    assert fast_lanes(t.clone()) == base  # control: a copy of the same bits is the same
    # first, middle and last byte; the last bytes sit in the zero-padded tail word when n % 8
    for byte in sorted({0, n // 2, n - 1, n - 1 - (n % 8 or 8) + 1}):
        for bit in range(8):
            lanes = fast_lanes(_flip(t, byte, bit), chunk_bytes=16)
            assert all(a != b for a, b in zip(lanes, base, strict=True)), (byte, bit)


def test_every_single_bit_of_a_small_tensor_is_seen():
    t = torch.randn(5).bfloat16()  # 10 bytes: one full word and a padded one
    digests = {fast_digest(_flip(t, byte, bit)) for byte in range(10) for bit in range(8)}
    assert len(digests) == 80 and fast_digest(t) not in digests


def test_swapped_words_and_elements_change_it():
    t = torch.randn(64, 64).bfloat16()
    words = t.clone()
    w = words.view(-1).view(torch.int64)
    w[[3, 100]] = w[[100, 3]]
    elems = t.clone().view(-1)
    elems[[0, 1]] = elems[[1, 0]]  # two bf16 inside one word
    assert len({fast_digest(x) for x in (t, words, elems, t.t().contiguous())}) == 4
    assert not torch.equal(words, t) and not torch.equal(elems, t)  # control: they did change


def test_dtype_and_shape_are_part_of_the_digest():
    t = torch.randn(4, 6).bfloat16()
    same_bytes = [t, t.view(torch.int16), t.reshape(6, 4), t.reshape(24)]
    assert len({tuple(fast_lanes(x)) for x in same_bytes}) == 1  # control: the same words
    assert len({fast_digest(x) for x in same_bytes}) == 4


def test_non_contiguous_input_digests_its_logical_contents():
    t = torch.randn(32, 48).bfloat16()
    views = [t.t(), t[:, ::2], t[1::3, 5:], t[:1].expand(32, 48), t.reshape(4, 8, 48).permute(1, 2, 0)]
    for v in views:
        assert not v.is_contiguous()
        assert fast_digest(v, chunk_bytes=24) == fast_digest(v.contiguous())
    assert fast_digest(t.t()) != fast_digest(t)  # control: a transpose is other contents


def test_zero_element_tensors():
    shapes = [(0,), (0, 3), (3, 0), (2, 0, 5)]
    for s in shapes:
        assert fast_lanes(torch.empty(s)) == [0, 0, 0, 0]
    assert len({fast_digest(torch.empty(s)) for s in shapes}) == len(shapes)
    assert fast_digest(torch.empty(0)) == fast_digest(torch.empty(0))


def test_kinds_and_refusals():
    t = torch.randn(10).bfloat16()
    assert (
        tensor_digest(t)
        == sha256_digest(t)
        == hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    )
    assert tensor_digest(t, "fast") == fast_digest(t) != sha256_digest(t)
    assert DIGEST_KINDS == ("fast", "sha256")
    with pytest.raises(ValueError, match="digest kind must be one of"):
        tensor_digest(t, "md5")
    with pytest.raises(ValueError, match="chunk_bytes must be a multiple of 8"):
        fast_digest(t, chunk_bytes=12)
    with pytest.raises(ValueError, match="dense tensor with data"):
        fast_digest(torch.empty(3, device="meta"))
    with pytest.raises(TypeError, match="expected a tensor"):
        fast_digest([1, 2])


# -- the fused (torch.compile) path: the same bits as the eager one ----------------------------


def _spy_fused(monkeypatch) -> list[int]:
    """Count the chunks that go through the compiled path (which must not fall back)."""
    calls, real = [], digest._fused_mix_sum()

    def spy(*args):
        calls.append(args[0].numel())
        return real(*args)

    monkeypatch.setattr(digest, "_fused_mix_sum", lambda: spy)
    return calls


def test_fused_lanes_equal_the_eager_lanes_and_the_reference(monkeypatch):
    calls = _spy_fused(monkeypatch)
    x = torch.randn(9_001).bfloat16()  # 4500 words and a padded one
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused = fast_lanes(x, fused=True)
        assert fused == fast_lanes(x, fused=False) == _ref_lanes(x)
        y = torch.randn(700, 300).bfloat16().t()[::2]  # non-contiguous, 52,500 words
        for chunk in (2**15 + 8, 2**17, 2**20):
            assert fast_lanes(y, chunk, fused=True) == fast_lanes(y.contiguous(), fused=False)
    assert not [w for w in seen if "torch.compile failed" in str(w.message)]  # no eager fallback
    assert calls and min(calls) >= digest.FUSED_MIN_WORDS  # the compiled path ran, on big chunks
    assert fast_digest(x, fused=True) == fast_digest(x, fused=False)


def test_fused_is_the_default_for_large_tensors_only(monkeypatch):
    calls = _spy_fused(monkeypatch)
    monkeypatch.setattr(digest, "FUSED_MIN_BYTES", 2**16)
    small, large = torch.randn(2**14).bfloat16(), torch.randn(2**15).bfloat16()  # 32 and 64 KiB
    fast_lanes(small)
    assert calls == []
    fast_lanes(large)
    assert calls == [2**13]  # one chunk of 8192 words


def test_a_compiler_failure_falls_back_to_the_same_bits_with_a_warning(monkeypatch):
    def broken(fn, **kw):
        def run(*args):
            raise RuntimeError("no compiler here")

        return run

    digest._fused_mix_sum.cache_clear()
    monkeypatch.setattr(torch, "compile", broken)
    try:
        x = torch.randn(2**14).bfloat16()
        with pytest.warns(UserWarning, match="torch.compile failed"):
            lanes = fast_lanes(x, fused=True)
        assert lanes == fast_lanes(x, fused=False)
    finally:
        digest._fused_mix_sum.cache_clear()


# -- `samebits rl` digests both sides with the configured kind --------------------------------


@pytest.mark.parametrize("kind", DIGEST_KINDS)
def test_rl_digests_engine_and_trainer_with_the_configured_kind(tiny, kind):
    loop = RLLoop(rl.RLConfig(model=str(tiny), digest_kind=kind))
    params = dict(loop.model.named_parameters())
    name = "model.norm.weight"
    assert loop.llm.weight_digests(name, kind=kind)[name] == tensor_digest(params[name], kind)
    assert loop.digest_mismatches() == []
    with torch.no_grad():  # negative control: one ulp the engine was not given
        params[name][0] = torch.nextafter(params[name][0], torch.tensor(10.0, dtype=params[name].dtype))
    assert loop.digest_mismatches() == [name]
    loop.sync_weights()
    assert loop.digest_mismatches() == []


def test_rl_default_is_fast_and_bad_kinds_are_refused(tiny):
    assert rl.RLConfig().digest_kind == "fast"
    with pytest.raises(ValueError, match="digest_kind must be one of"):
        rl.RLConfig(digest_kind="md5")
    with pytest.raises(ValueError, match="weight_digests: kind must be one of"):
        RLLoop(rl.RLConfig(model=str(tiny))).llm.weight_digests(kind="md5")


def test_cli_digest_kind_reaches_the_config(tmp_path, tiny):
    out = tmp_path / "run"
    args = ["rl", "--model", str(tiny), "--out", str(out), "--no-live", "--steps", "1"]
    assert main([*args, "--digest-kind", "sha256"]) == 0
    assert checkpoint.load(out / "checkpoint.pt")["config"]["digest_kind"] == "sha256"
    with pytest.raises(SystemExit):
        main([*args, "--digest-kind", "md5", "--overwrite"])


# -- CUDA: the same digest as on the CPU ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_tensors()))
def test_cuda_digest_equals_the_cpu_digest(name):
    t = _tensors()[name]
    assert fast_digest(t.cuda()) == fast_digest(t)
    assert fast_digest(t.cuda(), chunk_bytes=16) == fast_digest(t)


@pytest.mark.gpu
def test_cuda_fused_digest_equals_the_cpu_eager_digest():
    g = torch.Generator().manual_seed(2)
    t = torch.randn(64, 1536, 2048, generator=g).bfloat16()  # 384 MiB: fused by default
    d = t.cuda()
    want = fast_digest(t, fused=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert fast_digest(d) == want
        assert fast_digest(d, chunk_bytes=2**20 + 8, fused=True) == want
        assert fast_digest(d[:, :, 1:], fused=True) == fast_digest(t[:, :, 1:], fused=False)
    assert not [w for w in seen if "torch.compile failed" in str(w.message)]  # the compiled kernel ran
    flipped = d.clone()
    flipped.view(-1).view(torch.int16)[12345] ^= 1 << 15  # control: one sign bit
    assert fast_digest(flipped) != want


@pytest.mark.gpu
def test_cuda_digest_equals_the_cpu_digest_at_scale():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(3000, 2049, generator=g).bfloat16()  # 12.3 MB, odd byte count per row
    d = t.cuda()
    for chunk in (2**20, 2**22 + 8):  # several chunks, and one chunk size not a power of 2
        assert fast_digest(d, chunk_bytes=chunk) == fast_digest(t)
    assert fast_digest(d.t()) == fast_digest(t.t())  # non-contiguous on both devices
    assert fast_digest(d[:, 1:]) == fast_digest(t[:, 1:])  # misaligned rows: carried bytes
    flipped = d.clone()
    flipped.view(-1).view(torch.int16)[-1] ^= 1  # control: the device sees a flipped bit
    assert fast_digest(flipped) != fast_digest(t)
    assert fast_digest(torch.empty(0, 5, device="cuda")) == fast_digest(torch.empty(0, 5))


def test_resume_may_change_the_digest_kind_and_old_checkpoints_lack_it():
    saved = asdict(rl.RLConfig(digest_kind="sha256"))
    checkpoint.check_config(saved, rl.RLConfig())  # sha256 -> fast: allowed
    del saved["digest_kind"]  # a checkpoint written before the field existed
    checkpoint.check_config(saved, rl.RLConfig())
    saved["lr"] = 1.0  # control: a field that is the run's state is still refused
    with pytest.raises(rl.CheckpointError, match="lr: 1.0 -> 0.03"):
        checkpoint.check_config(saved, rl.RLConfig())


def test_the_lane_constants_are_odd_and_distinct():
    # an even multiplier would not be a bijection mod 2**64: one flipped top bit could vanish
    flat = [c for lane in LANES for c in lane]
    assert len(set(flat)) == 16 and all(c < 2**64 for c in flat)
    assert all(c % 2 for lane in LANES for c in (lane[0], lane[2], lane[3]))


@pytest.mark.gpu
def test_cuda_rl_digests_both_sides_on_the_device_and_equal_the_cpu_engine(tiny):
    from samebits import LLM

    loop = RLLoop(rl.RLConfig(model=str(tiny), device="cuda", steps=1))  # digest_kind "fast"
    row = loop.step()
    assert row["digest_mismatch_count"] == 0 and row["digests_checked"] == 36
    assert row["digests_agree"]
    # the CUDA engine's fast digests of its loaded weights equal the CPU engine's
    cuda_llm = LLM(str(tiny), device="cuda", max_num_seqs=1, max_model_len=16)
    cpu_llm = LLM(str(tiny), device="cpu", max_num_seqs=1, max_model_len=16)
    assert cuda_llm.weight_digests(kind="fast") == cpu_llm.weight_digests(kind="fast")
    p = dict(loop.model.named_parameters())["model.norm.weight"]
    with torch.no_grad():  # control: one ulp on the device that the engine was not given
        p[0] = torch.nextafter(p[0], torch.tensor(10.0, dtype=p.dtype, device=p.device))
    assert loop.digest_mismatches() == ["model.norm.weight"]
