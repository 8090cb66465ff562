"""Bit-exact round trips on the CPU path, exhaustive where the space is small."""
import io
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import portable_zip as pz
from conftest import CODED_DTYPES, WIDE_MIN, forced_plan, fresh_rng, random_bits, same_bits, weights


def roundtrip(t: torch.Tensor, **kw) -> torch.Tensor:
    buf = pz.compress(t, **kw)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == pz.inspect(buf)["compressed_bytes"]
    out = pz.decompress(buf)
    assert same_bits(out, t), f"round trip changed bits for {t.dtype}{list(t.shape)}"
    return buf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_pattern(dtype):
    rng = fresh_rng()
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    # In order, shuffled (mixing all patterns inside each block), and repeated
    # across many blocks.
    for perm in (np.arange(65536), rng.permutation(65536)):
        t = patterns[torch.from_numpy(perm)].view(dtype)
        roundtrip(t)
    roundtrip(patterns.repeat(5).view(dtype)[rng.permutation(5 * 65536)])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_fp8_pair(dtype):
    rng = fresh_rng()
    a, b = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8), indexing="ij")
    pairs = np.stack([a.ravel(), b.ravel()], axis=1)  # all 65,536 (x0, x1) pairs
    for order in (np.arange(65536), rng.permutation(65536)):
        roundtrip(torch.from_numpy(pairs[order].reshape(-1).copy()).view(dtype))
    # Odd element count: the last element pairs with the implicit zero.
    for last in range(256):
        t = torch.from_numpy(np.array([rng.integers(0, 256), rng.integers(0, 256), last], np.uint8)).view(dtype)
        roundtrip(t)


def test_fp32_bit_patterns():
    rng = fresh_rng()
    specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
                         0x7FBFFFFF, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF], np.uint32)
    bits = rng.integers(0, 2**32, size=300_000, dtype=np.uint32)
    bits[rng.integers(0, bits.size, 5000)] = rng.choice(specials, 5000)
    # NaNs with random payloads, subnormals of both signs.
    bits[:1000] = 0x7F800000 | rng.integers(1, 1 << 23, 1000, dtype=np.uint32) | (rng.integers(0, 2, 1000, dtype=np.uint32) << 31)
    bits[1000:2000] = rng.integers(1, 1 << 23, 1000, dtype=np.uint32) | (rng.integers(0, 2, 1000, dtype=np.uint32) << 31)
    roundtrip(torch.from_numpy(bits.view(np.int32)).view(torch.float32))
    roundtrip(torch.from_numpy(specials.view(np.int32)).view(torch.float32))


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 31, 32, 33, 4095, 4096, 4097, 65537, 1 << 20])
def test_sizes(coded_dtype, numel):
    rng = fresh_rng()
    roundtrip(weights(rng, numel, coded_dtype))
    roundtrip(random_bits(rng, numel, coded_dtype))
    roundtrip(weights(rng, numel, coded_dtype), codec="fixed")
    roundtrip(random_bits(rng, numel, coded_dtype), codec="fixed")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fixed_every_16bit_pattern(dtype):
    """All 65,536 patterns: most symbols escape; skewed repeats: few do."""
    rng = fresh_rng()
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    assert pz.inspect(roundtrip(patterns[torch.from_numpy(rng.permutation(65536))], codec="fixed"))["codec"] == "fixed"
    roundtrip(weights(rng, 300_001, dtype), codec="fixed")


def test_fixed_escapes_and_table_ties():
    """Exactly 7 symbols (no escapes), 8 symbols (one escapes), ties in counts."""
    for k in (1, 6, 7, 8, 9):
        exps = np.arange(120, 120 + k, dtype=np.uint16)
        bits = (np.resize(exps, 70_001) << 7).astype(np.uint16)
        roundtrip(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), codec="fixed")


def test_fixed_is_larger_but_bounded(coded_dtype):
    t = weights(fresh_rng(), 200_000, coded_dtype)
    rans, fixed = pz.compress(t), pz.compress(t, codec="fixed")
    assert pz.inspect(fixed)["codec"] == "fixed" and pz.inspect(rans)["codec"] == "rans"
    assert rans.numel() <= fixed.numel() <= pz.max_compressed_size(t.numel(), t.dtype)


def test_unknown_codec():
    with pytest.raises(ValueError, match="codec"):
        pz.compress(torch.zeros(4, dtype=torch.bfloat16), codec="lz4")


shapes = st.lists(st.integers(0, 70), min_size=0, max_size=4).filter(lambda s: int(np.prod(s)) <= 200_000)


@given(shape=shapes, dtype=st.sampled_from(CODED_DTYPES), scale=st.sampled_from([1e-30, 1e-3, 0.02, 1.0, 1e4]),
       kind=st.sampled_from(["normal", "bits", "constant", "sparse"]), seed=st.integers(0, 2**32 - 1))
def test_hypothesis_shapes(shape, dtype, scale, kind, seed):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape)) if shape else 1
    if kind == "bits":
        t = random_bits(rng, n, dtype)
    elif kind == "constant":
        t = torch.full((n,), scale).to(dtype)
    else:
        v = torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) * scale
        if kind == "sparse":
            v[torch.from_numpy(rng.random(n) < 0.9)] = 0
        t = v.to(dtype)
    roundtrip(t.reshape(shape))


@given(numel=st.integers(0, 300_000), odd=st.booleans(), seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]))
def test_hypothesis_fp8_sizes(numel, odd, seed, dtype):
    numel = numel | 1 if odd else numel
    roundtrip(weights(np.random.default_rng(seed), numel, dtype, 1.0))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
                                   torch.float64, torch.complex64, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz])
def test_non_float_dtypes_stored_raw(dtype):
    rng = fresh_rng()
    t = random_bits(rng, 1001, dtype, (7, 11, 13)) if dtype != torch.bool else torch.from_numpy(rng.random(1001) < .5)
    buf = roundtrip(t)
    info = pz.inspect(buf)
    assert info["codec"] == "raw" and info["dtype"] == dtype and info["shape"] == tuple(t.shape)


def test_zero_dim_tensor(coded_dtype):
    roundtrip(torch.tensor(1.5).to(coded_dtype))


def test_random_bits_never_grow_past_bound(coded_dtype):
    rng = fresh_rng()
    for numel in (1, 1000, 4096 * 3 + 5, 1 << 20):
        t = random_bits(rng, numel, coded_dtype)
        buf = roundtrip(t)
        bound = pz.max_compressed_size(numel, coded_dtype)
        assert buf.numel() <= bound
        nsym = (numel + 1) // 2 if coded_dtype.itemsize == 1 else numel
        blocks = -(-nsym // 4096)
        # Input + header (<= 32 + 8*16, padded) + per block: offset, checksum, mode byte, padding.
        assert bound <= t.nbytes + 176 + 16 + 28 * blocks + 32


def test_decode_truncated_to_reported_size(coded_dtype):
    rng = fresh_rng()
    t = weights(rng, 100_003, coded_dtype)
    padded = pz.compress(t, trim=False)
    assert padded.numel() == pz.max_compressed_size(t.numel(), t.dtype, t.dim())
    size = pz.compressed_size(padded)
    assert size < padded.numel()
    exact = padded[:size].clone()
    assert same_bits(pz.decompress(exact), t)
    assert same_bits(pz.decompress(padded), t)
    with pytest.raises(pz.FormatError, match="truncated"):
        pz.decompress(padded[: size - 1].clone())


def test_trimmed_cpu_stream_owns_exact_pages():
    """A trimmed CPU stream of a large tensor is its own mapping, cut to the
    stream's pages (no trim copy): same bytes as trim(padded), an ordinary
    writable tensor that survives torch.save and share_memory_, and its pages
    are returned when it dies (the process's mapping count does not grow)."""
    rng = fresh_rng()
    t = weights(rng, (17 << 20) + 7, torch.bfloat16)  # 34 MiB: past codec._MAPPED_MIN
    assert t.nbytes > pz.codec.streams._MAPPED_MIN
    buf = pz.compress(t, threads=2)
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/maps") as f:  # the mapping holding buf ends at its last page
        spans = [[int(v, 16) for v in line.split()[0].split("-")] for line in f]
    start, end = next(s for s in spans if s[0] <= buf.data_ptr() < s[1])
    assert end == -(-(buf.data_ptr() + buf.numel()) // page) * page, (hex(start), hex(end), buf.numel())
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    assert buf.numel() == pz.compressed_size(buf)
    assert torch.equal(buf, pz.trim(pz.compress(t, trim=False)))
    saved = io.BytesIO()
    torch.save(buf, saved)
    saved.seek(0)
    assert torch.equal(torch.load(saved), buf)
    buf.share_memory_()
    assert same_bits(pz.decompress(buf), t)
    buf[buf.numel() // 2] ^= 1  # writable: a raw byte flipped, which the block checksum catches
    with pytest.raises(pz.FormatError):
        pz.decompress(buf)

    def mappings():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    pz.compress(t)  # warm up
    before = mappings()
    for _ in range(20):
        del buf
        buf = pz.compress(t, threads=2)
    assert mappings() <= before + 2


def test_determinism_across_runs_and_threads(coded_dtype):
    t = weights(fresh_rng(), 1_000_003, coded_dtype)
    ref = pz.compress(t, threads=1)
    for threads in (1, 2, 3, 7):
        assert torch.equal(pz.compress(t, threads=threads), ref)
    assert same_bits(pz.decompress(ref, threads=5), t)


def test_decompress_into_out(coded_dtype):
    t = weights(fresh_rng(), 12345, coded_dtype).reshape(5, 2469)
    out = torch.empty_like(t)
    res = pz.decompress(pz.compress(t), out=out)
    assert res is out and same_bits(out, t)


@pytest.mark.parametrize("codec", ["rans", "fixed"])
def test_batch_api(coded_dtype, codec):
    rng = fresh_rng()
    ts = [weights(rng, n, coded_dtype) for n in (0, 1, 777, 70_000)] + [random_bits(rng, 99, torch.int64)]
    bufs = pz.compress_batch(ts, codec=codec)
    for t, b in zip(ts, bufs):  # trimmed on CPU, byte-identical to one call per tensor
        assert torch.equal(b, pz.compress(t, codec=codec))
    for t, r in zip(ts, pz.decompress_batch(bufs)):
        assert same_bits(r, t)
    outs = [torch.empty_like(t) for t in ts]
    pz.decompress_batch(bufs, out=outs)
    assert all(same_bits(o, t) for o, t in zip(outs, ts))
    padded = pz.compress_batch(ts, codec=codec, trim=False)
    assert all(p.numel() >= b.numel() and torch.equal(pz.trim(p), b) for p, b in zip(padded, bufs))
    with pytest.raises(ValueError, match="max_sms"):
        pz.compress_batch(ts, max_sms=0)


needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and pz.backend_info()["backend"] in ("cuda", "hip")),
                               reason="needs a GPU build and a GPU")


def _queued_round_trips(ts, stream):
    """Every GPU call that queues work, back to back on stream with no sync:
    compress one by one and as a batch, decode into out= one by one and as a
    batch. -> (outputs of the single decodes, outputs of the batch decode)"""
    with torch.cuda.stream(stream):
        singles = [pz.compress(t) for t in ts]
        batch = pz.compress_batch(ts)
        one = [torch.empty_like(t) for t in ts]
        for b, o in zip(singles, one):
            pz.decompress(b, out=o)
        many = [torch.empty_like(t) for t in ts]
        pz.decompress_batch(batch, out=many)
    return one, many


@pytest.mark.gpu
@needs_gpu
def test_gpu_queued_calls_reuse_workspaces_safely():
    """Queued calls reuse a workspace per (thread, stream) and an error slab
    per stream: back-to-back calls on one stream, on another, and from two
    threads at once, none synchronized, all decode right; a bad stream queued
    on a side stream is reported by pz.check(), and by a call that syncs
    that stream."""
    rng = fresh_rng()
    ts = [weights(rng, n, d).cuda() for n in (1, 4097, 300_001, 1 << 20) for d in (torch.bfloat16, torch.float32)]
    ts = ts * 3 + [random_bits(rng, 1001, torch.int32).cuda()]
    side = [torch.cuda.Stream() for _ in range(3)]
    torch.cuda.synchronize()  # the side streams read ts
    results = [_queued_round_trips(ts, torch.cuda.current_stream()), _queued_round_trips(ts, side[0])]
    with ThreadPoolExecutor(2) as pool:
        results += list(pool.map(_queued_round_trips, [ts, ts], side[1:]))
    torch.cuda.synchronize()
    pz.check()
    for one, many in results:
        assert all(same_bits(a, t) and same_bits(b, t) for t, a, b in zip(ts, one, many))
    good = pz.trim(pz.compress(ts[4]))  # 300,001 bf16 elements: a byte 100 from the end is coded data
    bad = good.clone()
    bad[-100] ^= 0x40
    torch.cuda.synchronize()
    with torch.cuda.stream(side[0]):
        pz.decompress(bad, out=torch.empty_like(ts[4]))
    with pytest.raises(pz.FormatError, match="decompress .queued.: corrupted stream"):
        pz.check()
    with torch.cuda.stream(side[1]):
        pz.decompress(bad, out=torch.empty_like(ts[4]))
        with pytest.raises(pz.FormatError, match="decompress .queued.: corrupted stream"):
            pz.inspect(good)  # its header copy syncs side[1]
    assert pz.codec.checks.pending() == 0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_calls_on_another_device_leave_the_current_device():
    """Calls on cuda:1 while cuda:0 is current run there and leave cuda:0 current."""
    t = weights(fresh_rng(), 70_001, torch.bfloat16)
    with torch.cuda.device(0):
        x = t.to("cuda:1")
        buf = pz.compress(x)
        out = torch.empty_like(x)
        pz.decompress(buf, out=out)
        batch = pz.compress_batch([x, x])
        outs = pz.decompress_batch(batch)
        assert torch.cuda.current_device() == 0
        pz.check()
    assert all(same_bits(o.cpu(), t) for o in [out] + outs)


def test_inspect_fields():
    t = weights(fresh_rng(), 1 << 20, torch.bfloat16).reshape(1024, 1024)
    info = pz.inspect(pz.compress(t))
    assert info["format_version"] == 4 and info["codec"] == "rans" and info["lanes"] == 32
    assert info["dtype"] == torch.bfloat16 and info["shape"] == (1024, 1024)
    assert info["original_bytes"] == t.nbytes
    assert 0.6 < info["ratio"] < 0.68
    assert info["raw_bytes"] == t.numel()  # one sign/mantissa byte per element


def test_wide_plan_from_2_27_symbols():
    """The encoder codes 2^15-symbol blocks with 64 lanes from 2^27 symbols on
    (2^14 and 32 lanes just below), and both round-trip."""
    rng = fresh_rng()
    for numel, lanes, block in ((WIDE_MIN - 1, 32, 1 << 14), (WIDE_MIN + 3, 64, 1 << 15)):
        t = random_bits(rng, numel, torch.bfloat16)
        t[: numel // 2] = weights(rng, numel // 2, torch.bfloat16)  # coded blocks and stored ones
        buf = pz.compress(t)
        info = pz.inspect(buf)
        assert (info["lanes"], info["block_symbols"]) == (lanes, block), info
        assert same_bits(pz.decompress(buf), t)
        del buf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_block_plan_by_symbol_count(dtype):
    """2^12-symbol blocks; 2^13 from 2^22 symbols (512 blocks); 2^14 from 2^25
    (2048 blocks): the C++ encoder and the reference agree at each edge."""
    from portable_zip.codec import reference as ref

    per = 2 if dtype == torch.float8_e4m3fn else 1  # fp8 codes element pairs
    for nsym, block in (((1 << 22) - 1, 1 << 12), (1 << 22, 1 << 13), ((1 << 25) - 1, 1 << 13), (1 << 25, 1 << 14)):
        info = pz.inspect(pz.compress(torch.zeros(nsym * per, dtype=dtype)))
        assert info["block_symbols"] == block == 1 << ref.block_log2_of(nsym, dtype != torch.float32), (dtype, nsym)


@pytest.mark.parametrize("block_log2", [10, 13, 15])
def test_wide_lanes_round_trip(coded_dtype, block_log2):
    """64 lanes with any block size (forced plan): partial last blocks and
    rows, skewed and random data, every thread count."""
    rng = fresh_rng()
    with forced_plan(block_log2, 64):
        for t in (weights(rng, 100_003, coded_dtype), random_bits(rng, 70_001, coded_dtype)):
            buf = pz.compress(t)
            assert pz.inspect(buf)["lanes"] == 64
            for threads in (1, 3):
                assert same_bits(pz.decompress(buf, threads=threads), t)


def test_backend_info():
    info = pz.backend_info()
    assert info["backend"] in ("cpu", "cuda", "hip")
    assert info["lanes"] == 32 and info["format_version"] == 4
