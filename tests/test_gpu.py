"""GPU suite (ci/gpu on the GPU machine): the CPU suite's checks on device
tensors, plus byte equality with the CPU codec in both directions."""
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import portable_zip as pz
from portable_zip import _C
from conftest import WIDE_MIN, forced_plan, fresh_rng, random_bits, same_bits, weights
from test_errors import resign, words_at_end_stream, words_run_out_stream
from test_fuzz import fuzz, make_streams, mutate, mutate_bytes

pytestmark = pytest.mark.gpu
if not (torch.cuda.is_available() and pz.backend_info()["backend"] in ("cuda", "hip")):
    pytest.skip("needs a GPU build and a GPU", allow_module_level=True)

DEV = "cuda"


def device_view(t_cpu: torch.Tensor, offset: int) -> torch.Tensor:
    """t_cpu's values on the GPU, `offset` elements into their storage (a CPU
    view moved with .to() lands at the start of a new, aligned allocation)."""
    flat = t_cpu.reshape(-1)
    base = torch.empty(flat.numel() + offset, dtype=t_cpu.dtype, device=DEV)
    v = base[offset:].view(t_cpu.shape)
    v.copy_(t_cpu)
    assert (v.data_ptr() % 16 != 0) == (offset * t_cpu.element_size() % 16 != 0)
    return v


def gpu_roundtrip(t_cpu: torch.Tensor, codec: str = "rans", offset: int = 0) -> None:
    """offset: compress a GPU view that many elements into its storage (the
    unaligned kernels when that is not a multiple of 16 bytes)."""
    t = device_view(t_cpu, offset) if offset else t_cpu.to(DEV)
    padded = pz.compress(t, codec=codec)
    gpu_stream = pz.trim(padded)
    cpu_stream = pz.compress(t_cpu, codec=codec)
    assert torch.equal(gpu_stream.cpu(), cpu_stream), f"GPU and CPU bytes differ for {t.dtype}{list(t.shape)}"
    assert same_bits(pz.decompress(padded).cpu(), t_cpu)          # GPU decodes GPU
    assert same_bits(pz.decompress(gpu_stream.cpu()), t_cpu)      # CPU decodes GPU
    assert same_bits(pz.decompress(cpu_stream.to(DEV)).cpu(), t_cpu)  # GPU decodes CPU


@pytest.mark.parametrize("numel", [0, 1, 33, 4097, 65537, 1 << 20, (1 << 22) + 3])
def test_gpu_sizes(coded_dtype, numel):
    rng = fresh_rng()
    gpu_roundtrip(weights(rng, numel, coded_dtype))
    gpu_roundtrip(random_bits(rng, numel, coded_dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_gpu_sizes_past_staging(dtype):
    """Blocks of 2^14 symbols (the plan from 2^25 symbols) whose rANS segments
    pass the encoder's 8 KB shared-memory staging (gpu_params.h: the rest
    spills to a global slot): same bytes as the CPU, and they decode."""
    per = 2 if dtype.itemsize == 1 else 1  # fp8 codes element pairs
    t = torch.from_numpy(fresh_rng().standard_normal(per << 25).astype(np.float32)).to(dtype)
    info = pz.inspect(pz.compress(t))
    assert info["block_symbols"] == 1 << 14 and info["coded_bytes"] > 8192 * info["blocks"], info
    gpu_roundtrip(t)


def test_gpu_sizes_past_staging_every_path():
    """The spill through each compress path: a partial last block that
    spills, an unaligned view (the unaligned kernel), a batch (the batched
    kernel) and one SM (every CTA reuses its slot for many blocks). Each
    against the CPU's bytes."""
    rng = fresh_rng()
    t = torch.from_numpy(rng.standard_normal((1 << 25) + 14_000).astype(np.float32)).to(torch.float16)
    assert pz.inspect(pz.compress(t))["block_symbols"] == 1 << 14
    gpu_roundtrip(t)  # the last block: 14,000 symbols, ~9.8 KB
    gpu_roundtrip(t, offset=1)
    u = torch.from_numpy(rng.standard_normal(1 << 25).astype(np.float32)).to(torch.float16)
    ts = [t, u]
    for got, x in zip(pz.compress_batch([x.to(DEV) for x in ts]), ts):
        assert torch.equal(pz.trim(got).cpu(), pz.compress(x))
    one = pz.trim(pz.compress(u.to(DEV), max_sms=1)).cpu()
    assert torch.equal(one, pz.compress(u))
    assert same_bits(pz.decompress(one.to(DEV)).cpu(), u)


def test_gpu_unaligned_every_misalignment(coded_dtype):
    """Views at every misalignment their dtype allows (the unaligned kernels
    load the 16-byte vectors around each chunk and shift them; the tensor's
    first chunk and the chunks near its end go element by element): sizes
    below one vector span, one row, a block's partial rows, several blocks,
    both codecs and 64 lanes, each against the CPU's bytes."""
    rng = fresh_rng()
    esize = torch.empty(0, dtype=coded_dtype).element_size()
    for offset in range(1, 16 // esize):
        for numel in (1, 9, 300, 4097 + 3 * offset, 70_001):
            gpu_roundtrip(weights(rng, numel, coded_dtype), offset=offset)
            gpu_roundtrip(random_bits(rng, numel, coded_dtype), offset=offset)
            gpu_roundtrip(weights(rng, numel, coded_dtype), "fixed", offset=offset)
    gpu_roundtrip(weights(rng, (1 << 20) + 5, coded_dtype), offset=1)
    with forced_plan(15, 64):
        gpu_roundtrip(weights(rng, (1 << 17) + 77, coded_dtype), offset=16 // esize - 1)


@pytest.mark.parametrize("numel", [1, 33, 4097, 65537, (1 << 22) + 3])
def test_gpu_fixed_codec(coded_dtype, numel):
    rng = fresh_rng()
    gpu_roundtrip(weights(rng, numel, coded_dtype), "fixed")
    gpu_roundtrip(random_bits(rng, numel, coded_dtype), "fixed")


def test_gpu_fixed_escapes():
    for k in (1, 7, 8, 9):
        bits = (np.resize(np.arange(120, 120 + k, dtype=np.uint16), 70_001) << 7).astype(np.uint16)
        gpu_roundtrip(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), "fixed")
    p = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    gpu_roundtrip(p[torch.from_numpy(fresh_rng().permutation(65536))].view(torch.bfloat16), "fixed")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_every_16bit_pattern(dtype):
    p = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    gpu_roundtrip(p.view(dtype))
    gpu_roundtrip(p.repeat(7)[torch.from_numpy(fresh_rng().permutation(7 * 65536))].view(dtype))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_gpu_every_fp8_pair(dtype):
    a, b = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8), indexing="ij")
    pairs = np.stack([a.ravel(), b.ravel()], axis=1)[fresh_rng().permutation(65536)]
    gpu_roundtrip(torch.from_numpy(pairs.reshape(-1).copy()).view(dtype))
    gpu_roundtrip(torch.from_numpy(pairs.reshape(-1)[:-1].copy()).view(dtype))  # odd count


def test_gpu_fp32_bits():
    gpu_roundtrip(random_bits(fresh_rng(), 500_001, torch.float32))


def test_gpu_shapes_and_raw_dtypes():
    rng = fresh_rng()
    gpu_roundtrip(weights(rng, 3 * 5 * 7 * 11, torch.bfloat16).reshape(3, 5, 7, 11))
    gpu_roundtrip(torch.tensor(0.5, dtype=torch.float16))
    for dtype in (torch.int32, torch.uint8, torch.float64, torch.float8_e4m3fnuz):
        gpu_roundtrip(random_bits(rng, 10_001, dtype))


def test_gpu_deterministic():
    t = weights(fresh_rng(), 16 << 20, torch.bfloat16).to(DEV)
    first = pz.trim(pz.compress(t))
    for _ in range(5):
        assert torch.equal(pz.trim(pz.compress(t)), first)


def test_gpu_decompress_into_out(coded_dtype):
    t = weights(fresh_rng(), 300_001, coded_dtype).to(DEV)
    out = torch.empty_like(t)
    assert pz.decompress(pz.compress(t), out=out) is out and same_bits(out, t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_gpu_wide_lanes(dtype):
    """64-lane rANS (two states a GPU lane; the encoder's plan from 2^27
    symbols on, forced here on 17-33 blocks), every coded dtype: GPU bytes ==
    CPU bytes, decoded by both, through the host-parsed kernel and the
    device-parsed fast path (out=), with a partial last block and row, and
    random bits (stored blocks)."""
    rng = fresh_rng()
    with forced_plan(15, 64):
        for t in (weights(rng, (1 << 20) + 12_345, dtype), random_bits(rng, 70_001, dtype)):
            cpu = pz.compress(t)
            info = pz.inspect(cpu)
            assert info["lanes"] == 64 and info["block_symbols"] == 1 << 15, info
            gpu_roundtrip(t)
            out = torch.empty_like(t, device=DEV)
            pz.decompress(cpu.to(DEV), out=out, check=True)
            assert same_bits(out.cpu(), t)


def test_gpu_wide_lanes_every_path():
    """64 lanes through the other compress paths, against the CPU's bytes:
    the encoder's own plan at 2^27 symbols, an unaligned view, one SM (every
    CTA reuses its spill slots), a batch mixing 64- and 32-lane tensors (one
    kernel, both coders), decompress_batch (the device-parsed general
    kernel, both decoders), and the fixed code's stream of the same tensor
    into out=."""
    rng = fresh_rng()
    big = weights(rng, WIDE_MIN + 1000, torch.bfloat16)
    gpu_roundtrip(big)
    with forced_plan(15, 64):
        t = weights(rng, (1 << 20) + 1000, torch.bfloat16)
        gpu_roundtrip(t, offset=3)
        one = pz.trim(pz.compress(t.to(DEV), max_sms=1)).cpu()
        assert torch.equal(one, pz.compress(t))
        assert same_bits(pz.decompress(one.to(DEV), max_sms=1).cpu(), t)
    ts = [big, weights(rng, 70_001, torch.bfloat16), weights(rng, 1, torch.bfloat16)]
    got = pz.compress_batch([x.to(DEV) for x in ts])
    assert [pz.inspect(g)["lanes"] for g in got] == [64, 32, 32]
    for g, x in zip(got, ts):
        assert torch.equal(pz.trim(g).cpu(), pz.compress(x))
    outs = [torch.empty_like(x, device=DEV) for x in ts]
    pz.decompress_batch(got, out=outs)
    pz.check()
    assert all(same_bits(o.cpu(), x) for o, x in zip(outs, ts))
    # The device-parsed decode sizes its tickets by the 32-lane plan: a
    # fixed-code stream of the same tensor (2^14-symbol blocks) decodes too.
    fixed = pz.compress(big.to(DEV), codec="fixed")
    assert pz.inspect(fixed)["block_symbols"] == 1 << 14
    out = torch.empty_like(big, device=DEV)
    pz.decompress(fixed, out=out, check=True)
    assert same_bits(out.cpu(), big)


def test_gpu_decodes_wide_goldens():
    """The reference encoder's small 64-lane streams (any block size, partial
    rows; tests/golden/v4) decode on the GPU, host- and device-parsed."""
    golden = Path(__file__).resolve().parent / "golden" / "v4"
    wide = {k: m for k, m in json.loads((golden / "manifest.json").read_text()).items() if "plan" in m}
    assert len(wide) == 5
    for name, meta in wide.items():
        dtype = getattr(torch, meta["dtype"])
        t = torch.frombuffer(bytearray((golden / f"{name}.in").read_bytes()), dtype=torch.uint8).view(dtype)
        t = t.reshape(meta["shape"])
        buf = torch.frombuffer(bytearray((golden / f"{name}.pz").read_bytes()), dtype=torch.uint8).to(DEV)
        assert same_bits(pz.decompress(buf).cpu(), t), name
        out = torch.empty_like(t, device=DEV)
        pz.decompress(buf, out=out, check=True)
        assert same_bits(out.cpu(), t), name


def test_gpu_errors():
    t = weights(fresh_rng(), 1000, torch.bfloat16)
    with pytest.raises(ValueError, match="is on"):
        pz.decompress(pz.compress(t.to(DEV)), out=torch.empty_like(t))
    with pytest.raises(ValueError, match="contiguous"):
        pz.compress(t.to(DEV).reshape(10, 100).t())


def test_gpu_mutated_streams():
    """Every mutant of a GPU-made stream, decoded on the GPU: FormatError or
    the original bits. PZ_GPU_FUZZ mutants (default 3000), half of them 1-4
    byte changes; PZ_GPU_FUZZ_SECONDS stops early (under a sanitizer) and the
    count that ran is printed."""
    rng = fresh_rng()
    count = int(os.environ.get("PZ_GPU_FUZZ", "3000"))
    seconds = float(os.environ.get("PZ_GPU_FUZZ_SECONDS", "inf"))
    streams = make_streams(rng, DEV)
    start, done, total = time.monotonic(), 0, {}
    while done < count and time.monotonic() - start < seconds:
        k = min(200, count - done)
        # Alternating: byte or structural mutants, decoded after a header read
        # on the host, or into out= by the kernels that parse the header.
        for name, v in fuzz(streams, rng, k, DEV, mutator=mutate_bytes if (done // 200) % 2 else mutate,
                            into_out=(done // 400) % 2 == 1).items():
            total[name] = total.get(name, 0) + v
        done += k
    print(f"gpu fuzz: {done} mutated streams in {time.monotonic() - start:.0f} s: {total}")
    assert total["decode error"] > done // 10, total
    # The device is still healthy after hostile input.
    gpu_roundtrip(weights(rng, 100_000, torch.bfloat16))


def test_gpu_raw_streams():
    """Raw dtypes go through the raw kernel: payloads of several 64 KiB
    checksum chunks with odd tails, bools, empty tensors, unaligned views."""
    rng = fresh_rng()
    for numel in (0, 1, 3, 65_537, 200_003):
        gpu_roundtrip(random_bits(rng, numel, torch.uint8))
        gpu_roundtrip(torch.from_numpy(rng.integers(0, 2, numel).astype(np.bool_)))
    gpu_roundtrip(random_bits(rng, 70_001, torch.int64).reshape(-1, 1))
    base = random_bits(rng, 100_003, torch.int16).to(DEV)
    view = base[3:]  # 6 bytes into its storage: the unaligned (word) path
    assert view.data_ptr() % 16
    assert torch.equal(pz.trim(pz.compress(view)).cpu(), pz.compress(view.cpu()))
    out = torch.empty(100_001, dtype=torch.int16, device=DEV)[1:]  # unaligned output
    assert same_bits(pz.decompress(pz.compress(view), out=out).cpu(), view.cpu())


def test_gpu_checksums_catch_what_decodes():
    """Corruptions the decoder alone cannot see: a raw-plane bit, a raw
    payload bit, a relabelled dtype with a forged header checksum, a uint8
    stream relabelled as bool (no invalid bool may reach the output)."""
    rng = fresh_rng()
    for t in (weights(rng, 300_001, torch.bfloat16), random_bits(rng, 300_001, torch.int32)):
        buf = pz.trim(pz.compress(t.to(DEV)))
        info = pz.inspect(buf)
        bad = buf.clone()
        bad[(info["header_bytes"] + 15) // 16 * 16 + 200_000] ^= 4
        with pytest.raises(pz.FormatError, match="checksum"):
            pz.decompress(bad)
    buf = pz.trim(pz.compress(weights(rng, 300_001, torch.bfloat16).to(DEV))).cpu()
    buf[5] = 2
    with pytest.raises(pz.FormatError, match="header checksum"):
        pz.decompress(buf.to(DEV))
    with pytest.raises(pz.FormatError, match="checksum"):
        pz.decompress(resign(buf).to(DEV))
    u8 = random_bits(rng, 200_003, torch.uint8)
    buf = pz.compress(u8).clone()
    buf[5] = 12
    out = torch.zeros(200_003, dtype=torch.bool, device=DEV)
    with pytest.raises(pz.FormatError, match="bool"):
        pz.decompress(resign(buf).to(DEV), out=out, check=True)
    assert int(out.view(torch.uint8).max()) <= 1


@pytest.mark.parametrize("version", [1, 2])
def test_gpu_decodes_old_goldens(version):
    """v1 (no checksums) and v2 (strided lanes, a unit per symbol) streams decode on the GPU."""
    golden = Path(__file__).resolve().parent / "golden"
    golden = golden if version == 1 else golden / f"v{version}"
    for name, meta in json.loads((golden / "manifest.json").read_text()).items():
        raw = (golden / f"{name}.in").read_bytes()
        dtype = getattr(torch, meta["dtype"])
        t = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype))
        buf = torch.frombuffer(bytearray((golden / f"{name}.pz").read_bytes()), dtype=torch.uint8).to(DEV)
        assert pz.inspect(buf)["format_version"] == version
        assert same_bits(pz.decompress(buf).cpu(), t.reshape(meta["shape"])), name


def test_gpu_out_overlapping_stream():
    t = weights(fresh_rng(), 10_000, torch.bfloat16).to(DEV)
    buf = pz.compress(t)
    with pytest.raises(ValueError, match="overlaps"):
        pz.decompress(buf, out=buf[: t.nbytes].view(torch.bfloat16))
    c = torch.randn(1000, dtype=torch.complex64, device=DEV)
    assert same_bits(pz.decompress(pz.compress(c.conj())).cpu(), c.conj().resolve_conj().cpu())
    with pytest.raises(ValueError, match="lazy"):
        pz.decompress(pz.compress(c), out=torch.empty_like(c).conj())


@pytest.mark.slow
def test_gpu_over_4gib():
    n = (7 << 30) // 2  # 7 GiB of bf16: stream, offsets and sizes all past 32 bits
    t = (torch.randn(n, device=DEV) * 0.02).to(torch.bfloat16)
    buf = pz.compress(t)
    info = pz.inspect(buf)
    assert info["compressed_bytes"] > 1 << 32 and info["ratio"] < 0.68
    out = pz.decompress(buf)
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))
    del out
    # The last blocks' bytes agree with the CPU codec on the same tail.
    tail = t[-(1 << 20):].cpu()
    assert torch.equal(pz.trim(pz.compress(tail.to(DEV))).cpu(), pz.compress(tail))


@pytest.mark.parametrize("max_sms", [1, 3, 33])
def test_gpu_sm_budget_same_bytes(max_sms):
    """A smaller persistent grid loops over more blocks per CTA; the bytes and
    the decode must not change."""
    rng = fresh_rng()
    t = weights(rng, (1 << 22) + 5, torch.bfloat16).to(DEV)
    ref = pz.trim(pz.compress(t))
    small = pz.trim(pz.compress(t, max_sms=max_sms))
    assert torch.equal(small, ref)
    with pz.sm_budget(max_sms):
        assert torch.equal(pz.trim(pz.compress(t)), ref)
        assert same_bits(pz.decompress(ref), t)
    assert same_bits(pz.decompress(ref, max_sms=max_sms), t)


def test_gpu_sm_budget_rejects_bad_values():
    t = torch.zeros(10, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="max_sms"):
        pz.compress(t, max_sms=0)
    with pytest.raises(ValueError, match="max_sms"):
        with pz.sm_budget(-1):
            pass


def launched(fn) -> dict:
    """The launch report (_C.launch_report) of the GPU codec launches fn makes."""
    _C.launch_report(reset=True)
    fn()
    torch.cuda.synchronize()
    return _C.launch_report(reset=True)


def test_gpu_launch_report_shows_the_sm_budget():
    """An SM budget reaches every GPU launch path, by the codec's own account
    of the grids it launched: compress (coded, stored raw, batch), decompress
    (coded, raw), device-parsed decodes into out= (a single job's two
    launches, the second its fast path whatever the stream; a batch's one).
    Without a budget, grids are sized for every SM, and a large tensor's grid
    fills more SMs than the budget allows."""
    rng = fresh_rng()
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert sms > 2, "the budget of 2 SMs must be below the device's SM count"
    big = weights(rng, 1 << 24, torch.bfloat16).to(DEV)    # 2,048 blocks: more CTAs than 2 SMs hold
    other = weights(rng, 300_001, torch.bfloat16).to(DEV)
    raw = random_bits(rng, 1 << 22, torch.int32).to(DEV)   # stored raw: the raw-stream kernel
    bufs = {k: pz.compress(t) for k, t in (("big", big), ("other", other), ("raw", raw))}
    fixed = pz.compress(big, codec="fixed")
    out, out2 = torch.empty_like(big), torch.empty_like(other)
    paths = {  # name: (call, its launches)
        "compress": (lambda: pz.compress(big, max_sms=2), 1),
        "compress fixed": (lambda: pz.compress(big, max_sms=2, codec="fixed"), 1),
        "compress raw": (lambda: pz.compress(raw, max_sms=2), 1),
        "compress batch": (lambda: pz.compress_batch([big, other], max_sms=2), 1),
        "decompress": (lambda: pz.decompress(bufs["big"], max_sms=2), 1),
        "decompress raw": (lambda: pz.decompress(bufs["raw"], max_sms=2), 1),
        "decode rans out=": (lambda: pz.decompress(bufs["big"], out=out, max_sms=2, check=True), 2),
        "decode fixed out=": (lambda: pz.decompress(fixed, out=out, max_sms=2, check=True), 2),
        "decode batch out=": (lambda: pz.decompress_batch([bufs["big"], bufs["other"]], out=[out, out2],
                                                          max_sms=2, check=True), 1),
    }
    for name, (call, launches) in paths.items():
        rep = launched(call)
        assert rep["launches"] == launches, (name, rep)
        assert 1 <= rep["max_grid_sms"] <= rep["max_sms"] <= 2 and rep["max_grid"] >= 1, (name, rep)
    assert same_bits(out, big) and same_bits(out2, other)
    with pz.sm_budget(2):  # the thread's budget, as a Communicator sets it
        rep = launched(lambda: pz.decompress(pz.compress(big), out=out, check=True))
    assert rep["launches"] == 3 and rep["max_sms"] <= 2, rep
    budgeted = launched(lambda: pz.decompress(bufs["big"], max_sms=2))
    full = launched(lambda: pz.decompress(bufs["big"]))
    assert full["launches"] == 1 and full["max_sms"] == sms, (full, sms)
    assert 2 < full["max_grid_sms"] <= sms and full["max_grid"] > budgeted["max_grid"], (full, budgeted)
    assert _C.launch_report() == {"launches": 0, "max_grid": 0, "max_sms": 0, "max_grid_sms": 0}  # reset


@pytest.mark.parametrize("codec", ["rans", "fixed"])
def test_gpu_compress_batch_one_launch(codec):
    """A batch of mixed dtypes, sizes (empty, tiny, multi-block, odd fp8),
    raw dtypes and an unaligned view: the same bytes as one call per tensor."""
    rng = fresh_rng()
    ts = [weights(rng, n, torch.bfloat16) for n in (0, 1, 4097, 300_001, 1 << 20)]
    ts += [weights(rng, n, torch.float8_e4m3fn) for n in (1, 70_001)]
    ts += [random_bits(rng, 65_537, torch.float16), random_bits(rng, 999, torch.int32)]
    ts = [t.to(DEV) for t in ts] + [device_view(weights(rng, 50_001, torch.bfloat16), 1)]  # 2 bytes into its storage
    bufs = pz.compress_batch(ts, codec=codec)
    for t, b in zip(ts, bufs):
        assert torch.equal(pz.trim(b).cpu(), pz.compress(t.cpu(), codec=codec))  # the CPU's bytes
        assert same_bits(pz.decompress(b), t)
    trimmed = pz.compress_batch(ts, codec=codec, trim=True, max_sms=2)
    assert all(torch.equal(a, pz.trim(b)) for a, b in zip(trimmed, bufs))


def test_gpu_decompress_out_queues_without_sync():
    """decompress(out=) parses the header on the device: no host sync (the
    call returns while a long kernel ahead of it on the stream still runs),
    and every dtype, shape and codec decodes bit for bit."""
    rng = fresh_rng()
    big = torch.randn(1 << 26, device=DEV)
    cases = [weights(rng, n, d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                          torch.float8_e5m2) for n in (0, 1, 4097, 300_001)]
    cases += [random_bits(rng, 70_000, torch.int64).reshape(-1, 7), random_bits(rng, 3, torch.uint8),
              torch.from_numpy(rng.integers(0, 2, 65_539).astype(np.bool_))]
    for t in cases:
        for codec in ("rans", "fixed"):
            buf = pz.compress(t.to(DEV), codec=codec)
            out = torch.empty_like(t, device=DEV)
            pz.decompress(buf, out=out)  # warm: the kernel is loaded
            pz.check()
            out.view(torch.uint8).fill_(0x5A)
            torch.cuda.synchronize()
            for _ in range(40):
                big.mul_(1.0001)  # ~5 ms of queued work
            t0 = time.perf_counter()
            pz.decompress(buf, out=out)
            queued = time.perf_counter() - t0
            ahead = torch.cuda.Event()
            ahead.record()
            assert not ahead.query(), "the stream drained before the decode was queued: the call synchronized"
            pz.check()
            assert same_bits(out.cpu(), t), (t.dtype, t.numel(), codec, queued)
    assert pz.codec.checks.pending() == 0


def test_gpu_deferred_errors():
    """A bad stream decoded into out= raises at pz.check() (once), or at the
    next call that synchronizes on its stream; check=True raises at once."""
    rng = fresh_rng()
    t = weights(rng, 300_001, torch.bfloat16).to(DEV)
    buf = pz.trim(pz.compress(t))
    bad = buf.clone()
    bad[-100] ^= 0x40
    out = torch.empty_like(t)
    pz.decompress(bad, out=out)  # queued: no error yet
    with pytest.raises(pz.FormatError, match="decompress .queued.: corrupted stream"):
        pz.check()
    pz.check()  # reported once
    with pytest.raises(pz.FormatError, match="another dtype or shape"):
        pz.decompress(buf, out=torch.empty(300_000, dtype=torch.bfloat16, device=DEV), check=True)
    with pytest.raises(pz.FormatError, match="another dtype or shape"):
        pz.decompress(buf, out=torch.empty(300_001, dtype=torch.float16, device=DEV), check=True)
    with pytest.raises(pz.FormatError, match="truncated"):
        pz.decompress(buf[:1000], out=out, check=True)
    with pytest.raises(pz.FormatError, match="bad magic"):
        pz.decompress(torch.zeros(4096, dtype=torch.uint8, device=DEV), out=out, check=True)
    pz.decompress(bad, out=out)
    with pytest.raises(pz.FormatError, match="corrupted stream"):
        pz.inspect(buf)  # synchronizes the stream, so it reports the queued failure
    pz.inspect(buf)
    assert same_bits(pz.decompress(buf, out=out, check=True).cpu(), t.cpu())


def test_gpu_decompress_batch_one_launch_per_dtype():
    """decompress_batch on the GPU: one launch per dtype (raw dtypes share
    one), outputs given or allocated, a corrupted member named."""
    rng = fresh_rng()
    ts = [weights(rng, n, d) for n in (5, 70_001, 1 << 20) for d in (torch.bfloat16, torch.float32)]
    ts += [random_bits(rng, 1000, torch.int32), torch.from_numpy(rng.integers(0, 2, 999).astype(np.bool_))]
    bufs = [pz.compress(t.to(DEV), codec=c) for t, c in zip(ts, ["rans", "fixed"] * len(ts))]
    for got, t in zip(pz.decompress_batch(bufs), ts):
        assert same_bits(got.cpu(), t)
    outs = [torch.empty_like(t, device=DEV) for t in ts]
    assert all(a is b for a, b in zip(pz.decompress_batch(bufs, out=outs), outs))
    pz.check()
    for o, t in zip(outs, ts):
        assert same_bits(o.cpu(), t)
    bad = list(bufs)
    bad[4] = pz.trim(bufs[4]).clone()
    bad[4][-50] ^= 1
    with pytest.raises(pz.FormatError, match="decompress_batch:? stream 4"):
        pz.decompress_batch(bad)
    pz.decompress_batch(bad, out=outs)
    with pytest.raises(pz.FormatError, match="decompress_batch stream 4 .queued."):
        pz.check()


@pytest.mark.parametrize("lanes", [32, 64])
def test_gpu_mutated_words_run_out(lanes):
    """A segment that needs coded words it does not have, at the very end of
    its buffer: the GPU decoders (host-parsed, and device-parsed into out=)
    raise without reading past the stream (memcheck runs this: "mutated")."""
    buf = words_run_out_stream(lanes).to(DEV)
    with pytest.raises(pz.FormatError, match="coded data is inconsistent"):
        pz.decompress(buf)
    with pytest.raises(pz.FormatError, match="coded data is inconsistent"):
        pz.decompress(buf, out=torch.empty(4096, dtype=torch.bfloat16, device=DEV), check=True)


@pytest.mark.parametrize("lanes", [32, 64])
def test_gpu_mutated_words_at_end(lanes):
    """A segment ending its buffer exactly, whose first steps need no word:
    the decoders raise without reading past the stream (memcheck runs this;
    64 lanes: the two-state decoders)."""
    buf = words_at_end_stream(lanes).to(DEV)
    with pytest.raises(pz.FormatError):
        pz.decompress(buf)
    with pytest.raises(pz.FormatError):
        pz.decompress(buf, out=torch.empty(4096, dtype=torch.bfloat16, device=DEV), check=True)


def _outcome(buf: torch.Tensor, like: torch.Tensor = None):
    """('ok', bits) or ('error', message) of one decode; like: decode into an
    out= of its dtype and shape (the kernels that parse the header)."""
    try:
        if like is None:
            out = pz.decompress(buf)
        else:
            out = torch.empty_like(like, device=buf.device)
            pz.decompress(buf, out=out, check=True)
        return "ok", out.cpu().view(torch.uint8).numpy().tobytes()
    except pz.FormatError as e:
        return "error", str(e)


def _table_streams(rng, count: int):
    """One-block fp16 streams (4096 symbols, 32 lanes) whose symbol (the high
    byte) takes 1-256 values with skewed counts: tables of both forms, of 1-
    and 2-byte varints, up to 545 bytes long. -> (tensor, stream, offset of
    its table)."""
    out = []
    while len(out) < count:
        k = int(rng.integers(1, 257))
        # scattered symbols (bitmap tables mostly), or a run of them (range tables)
        syms = (rng.choice(256, k, replace=False) if rng.integers(0, 2) else rng.integers(0, 257 - k) + np.arange(k))
        syms = syms.astype(np.uint16)
        p = rng.dirichlet(np.full(k, float(rng.choice([0.05, 0.5, 5.0]))))
        hi = syms[rng.choice(k, 4096, p=p)]
        t = torch.from_numpy((hi << 8 | rng.integers(0, 256, 4096, dtype=np.uint16)).astype(np.int16)).view(torch.float16)
        with forced_plan(12, 32):
            buf = pz.trim(pz.compress(t))
        info = pz.inspect(buf)
        seg = info["compressed_bytes"] - info["coded_bytes"]
        if info["blocks"] != 1 or int(buf[seg]) != 1:  # not a rANS segment (stored: the table would not pay)
            continue
        out.append((t, buf, seg + 1))
    return out


def test_gpu_mutated_tables_match_cpu():
    """The GPU's table parse against the CPU's: valid tables of every shape
    decode to the same bits, and tables with 1-3 bytes changed (or their
    segment cut inside the table) are rejected as malformed tables by both or
    by neither, host-parsed and device-parsed.
    PZ_GPU_TABLE_FUZZ mutants (default 800); PZ_GPU_TABLE_FUZZ_SECONDS stops
    early (memcheck runs this: "mutated")."""
    from test_errors import one_block_stream

    rng = fresh_rng()
    count = int(os.environ.get("PZ_GPU_TABLE_FUZZ", "800"))
    seconds = float(os.environ.get("PZ_GPU_TABLE_FUZZ_SECONDS", "inf"))
    seen = {"ok": 0, "table": 0, "other": 0}
    start = time.monotonic()
    for t, buf, at in _table_streams(rng, max(8, count // 16)):
        if time.monotonic() - start > seconds:
            break
        want = t.view(torch.uint8).numpy().tobytes()
        assert _outcome(buf) == ("ok", want)
        assert _outcome(buf.to(DEV)) == ("ok", want)
        assert _outcome(buf.to(DEV), t) == ("ok", want)
        for _ in range(16):
            bad = buf.clone()
            # the table's head and first varints, or anywhere in its first 600 bytes
            span = min(buf.numel() - at, 40 if rng.integers(0, 2) else 600)
            cut = rng.integers(0, 4) == 0
            if cut:  # the segment cut inside its table, in a 4096-element bf16 stream
                seg = bad[at - 1:].numpy().tobytes()
                bad = one_block_stream(seg[: int(rng.integers(1, span))], 32)
            else:
                for _ in range(int(rng.integers(1, 4))):
                    i = at + int(rng.integers(0, span))
                    bad[i] = int(rng.integers(0, 256)) if rng.integers(0, 2) else int(bad[i]) ^ (1 << int(rng.integers(0, 8)))
            cpu = _outcome(bad)
            like = torch.empty(4096, dtype=torch.bfloat16) if cut else t
            for gpu in (_outcome(bad.to(DEV)), _outcome(bad.to(DEV), like)):
                assert gpu[0] == cpu[0], (cpu, gpu)
                if cpu[0] == "ok":
                    assert gpu == cpu
                else:
                    assert ("frequency table" in gpu[1]) == ("frequency table" in cpu[1]), (cpu, gpu)
            seen["ok" if cpu[0] == "ok" else "table" if "frequency table" in cpu[1] else "other"] += 1
    print(f"gpu table fuzz: {sum(seen.values())} mutated tables in {time.monotonic() - start:.0f} s: {seen}")
    assert seen["table"] > 0 and seen["other"] > 0
