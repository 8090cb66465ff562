"""pz.delta on the GPU (ci/gpu on the GPU machine): the GPU encoder writes the
CPU encoder's bytes, checksums agree, and GPU apply rebuilds exactly and
rejects what the CPU rejects, base untouched."""
import pytest
import torch

import portable_zip as pz
from conftest import CODED_DTYPES, fresh_rng, random_bits, same_bits, weights
from test_delta import BLOCK, as_int, ref, stepped

pytestmark = pytest.mark.gpu
if not (torch.cuda.is_available() and pz.backend_info()["backend"] in ("cuda", "hip")):
    pytest.skip("needs a GPU build and a GPU", allow_module_level=True)

DEV = "cuda"


def gpu_round_trip(base: torch.Tensor, target: torch.Tensor, **kw) -> torch.Tensor:
    """Encode on both devices (same bytes), apply each stream on both (same result)."""
    cpu = pz.delta.encode(base, target)
    gb, gt = base.to(DEV), target.to(DEV)
    gpu = pz.delta.encode(gb, gt, **kw)
    assert gpu.device.type == "cuda" and gpu.dtype == torch.uint8
    assert torch.equal(gpu.cpu(), cpu)
    for s in (gpu, cpu):
        got = gb.clone()
        pz.delta.apply(got, s, **kw)
        assert same_bits(got.cpu(), target)
    got = base.clone()
    pz.delta.apply(got, gpu)  # a GPU stream applied to a CPU base
    assert same_bits(got, target)
    return gpu


@pytest.mark.parametrize("n", [0, 1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 333])
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.3, 1.0])
def test_gpu_bytes_equal_cpu(coded_dtype, n, frac):
    rng = fresh_rng()
    base = weights(rng, n, coded_dtype)
    gpu_round_trip(base, stepped(rng, base, frac))


def test_gpu_arbitrary_bits(coded_dtype):
    rng = fresh_rng()
    n = 3 * BLOCK + 5
    gpu_round_trip(random_bits(rng, n, coded_dtype), random_bits(rng, n, coded_dtype))


def test_gpu_exhaustive_16_bit():
    pats = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        for d in (-3, 1, 2, 1 << 15):
            gpu_round_trip(pats.view(dtype), (pats.to(torch.int32) + d).to(torch.int16).view(dtype))


def test_gpu_exhaustive_fp8_pairs():
    pats = torch.arange(256, dtype=torch.uint8)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        gpu_round_trip(pats.repeat_interleave(256).view(dtype), pats.repeat(256).view(dtype))


def test_gpu_large_and_sm_budget():
    rng = fresh_rng()
    base = weights(rng, (1 << 24) + 12345, torch.bfloat16)
    gpu_round_trip(base, stepped(rng, base, 0.01), max_sms=4)


def test_gpu_checksum():
    rng = fresh_rng()
    for n in list(range(10)) + [4099, (1 << 22) + 3]:
        t = random_bits(rng, n, torch.uint8)
        want = ref.checksum(t.numpy().tobytes())
        assert pz.delta.checksum(t.to(DEV)) == want == pz.delta.checksum(t)
    # unaligned device views (the kernel's byte path)
    t = random_bits(rng, 1001, torch.uint8)
    g = t.to(DEV)
    for off in (1, 2, 3):
        assert pz.delta.checksum(g[off:]) == ref.checksum(t[off:].numpy().tobytes())


def check_rejected_gpu(base: torch.Tensor, stream: torch.Tensor) -> None:
    before = base.clone()
    with pytest.raises((pz.FormatError, pz.delta.BaseMismatch)):
        pz.delta.apply(base, stream)
    assert same_bits(base.cpu(), before.cpu())


def test_gpu_errors():
    rng = fresh_rng()
    base = weights(rng, 150, torch.bfloat16)
    target = stepped(rng, base, 0.1)
    s = pz.delta.encode(base, target)
    gb, gs = base.to(DEV), s.to(DEV)
    for cut in range(0, s.numel(), 7):
        check_rejected_gpu(gb, gs[:cut].clone())
    for i in range(0, s.numel() * 8, 3):
        bad = gs.clone()
        bad[i // 8] ^= 1 << (i % 8)
        check_rejected_gpu(gb, bad)
    other = gb.clone()
    as_int(other)[3] += 1
    with pytest.raises(pz.delta.BaseMismatch):
        pz.delta.apply(other, gs)
    check_rejected_gpu(gb.view(torch.float16), gs)


def test_gpu_resigned_never_silent():
    """Forged streams (valid checksums): rejected untouched, or a FormatError after the target check."""
    rng = fresh_rng()
    base = weights(rng, 2000, torch.bfloat16)
    target = stepped(rng, base, 0.1)
    s = pz.delta.encode(base, target).numpy().tobytes()
    gb = base.to(DEV)
    for _ in range(200):
        bad = bytearray(s)
        i = int(rng.integers(ref.HEADER, len(bad)))
        bad[i] ^= 1 << int(rng.integers(0, 8))
        forged = torch.frombuffer(ref.resign(bad), dtype=torch.uint8)
        cpu_got, gpu_got = base.clone(), gb.clone()
        outcomes = []
        for got in (cpu_got, gpu_got):
            try:
                pz.delta.apply(got, forged)
                outcomes.append("ok")
            except pz.FormatError as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1]  # the same verdict on both
        if outcomes[0] == "ok":
            assert same_bits(gpu_got.cpu(), target) and same_bits(cpu_got, target)
        assert same_bits(gpu_got.cpu(), cpu_got)


@pytest.mark.parametrize("dtype", CODED_DTYPES, ids=str)
def test_gpu_reference_bytes(dtype):
    rng = fresh_rng()
    base = weights(rng, BLOCK + 17, dtype)
    target = stepped(rng, base, 0.05, max_ulps=40)
    raw = lambda t: t.view(torch.uint8).numpy().tobytes()  # noqa: E731
    want = ref.encode(raw(base), raw(target), 8 * base.element_size(), pz.codec.code_of(dtype))
    assert pz.delta.encode(base.to(DEV), target.to(DEV)).cpu().numpy().tobytes() == want
