"""Bad input gets a clear error, never a crash."""
import numpy as np
import pytest
import torch

import portable_zip as pz
from conftest import forced_plan, fresh_rng, same_bits, weights


def stream(dtype=torch.bfloat16, numel=20_000):
    return pz.compress(weights(fresh_rng(), numel, dtype))


def test_non_tensor_input():
    with pytest.raises(TypeError, match="torch.Tensor"):
        pz.compress([1.0, 2.0])
    with pytest.raises(TypeError, match="uint8"):
        pz.decompress(b"PZIP")


def test_non_contiguous_input():
    t = weights(fresh_rng(), 64 * 64, torch.bfloat16).reshape(64, 64).t()
    with pytest.raises(ValueError, match="contiguous"):
        pz.compress(t)
    buf = stream()
    out = torch.empty(40_000, dtype=torch.bfloat16)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        pz.decompress(buf, out=out)


def test_wrong_stream_dtype():
    buf = stream()
    with pytest.raises(TypeError, match="uint8"):
        pz.decompress(buf.view(torch.int8))
    with pytest.raises(TypeError, match="1-D"):
        pz.decompress(buf[: buf.numel() // 2 * 2].reshape(2, -1))


def test_out_mismatch():
    buf = stream(numel=1000)
    with pytest.raises(ValueError, match="stream holds"):
        pz.decompress(buf, out=torch.empty(1000, dtype=torch.float16))
    with pytest.raises(ValueError, match="stream holds"):
        pz.decompress(buf, out=torch.empty(999, dtype=torch.bfloat16))


def test_not_a_stream():
    with pytest.raises(pz.FormatError, match="magic"):
        pz.decompress(torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(pz.FormatError, match="shorter"):
        pz.decompress(torch.zeros(5, dtype=torch.uint8))


def test_version_mismatch():
    buf = stream().clone()
    for v in (0, 5, 255):
        buf[4] = v
        with pytest.raises(pz.FormatError, match=f"version {v}; this build reads versions 1 to 4"):
            pz.decompress(buf)


@pytest.mark.parametrize("offset,value,msg", [
    (5, 0, "dtype"), (5, 200, "dtype"), (6, 7, "codec"), (7, 17, "ndim"), (24, 3, "parameters"),
    (25, 11, "parameters"), (26, 48, "parameters"), (27, 1, "parameters"), (32, 7, "shape"),
    (slice(8, 16), 0, "total"), (15, 1, "total"), (slice(8, 16), 0xFF, "total"),
])
def test_header_fields(offset, value, msg):
    buf = stream().clone()
    buf[offset] = value
    with pytest.raises(pz.FormatError, match=msg):
        pz.decompress(buf)


def test_lane_count_relabelled():
    """64 lanes is a v4 rANS plan: a forged header (checksum recomputed) that
    names it on a fixed-code or a v3 stream, or names 32 lanes on a 64-lane
    stream (or the reverse), never decodes to different data."""
    fixed = pz.compress(weights(fresh_rng(), 20_000, torch.bfloat16), codec="fixed").clone()
    fixed[26] = 64
    with pytest.raises(pz.FormatError, match="parameters"):
        pz.decompress(resign(fixed))
    v3 = stream().clone()
    v3[4], v3[26] = 3, 64
    with pytest.raises(pz.FormatError, match="parameters"):
        pz.decompress(resign(v3))
    with forced_plan(12, 64):
        wide = pz.compress(weights(fresh_rng(), 20_000, torch.bfloat16))
    for lanes in (64, 32):
        buf = stream().clone() if lanes == 64 else wide.clone()
        assert pz.inspect(buf)["lanes"] == 96 - lanes
        buf[26] = lanes
        with pytest.raises(pz.FormatError):
            pz.decompress(resign(buf))


def test_truncated():
    buf = stream()
    for cut in (0, 10, 31, 40, buf.numel() // 2, buf.numel() - 1):
        with pytest.raises(pz.FormatError):
            pz.decompress(buf[:cut].clone())


def align16(v):
    return (v + 15) // 16 * 16


def test_corrupted_offsets_and_segments():
    buf = stream(numel=200_000)  # bf16, 1-D: raw part is one byte per element
    info = pz.inspect(buf)
    offsets_begin = align16(align16(32 + 8) + 200_000)
    coded_begin = buf.numel() - info["coded_bytes"]
    bad = buf.clone()
    bad[offsets_begin: offsets_begin + 8] = 0x7F  # first block ends far outside the stream
    with pytest.raises(pz.FormatError, match="offset table"):
        pz.decompress(bad)
    bad = buf.clone()
    bad[coded_begin] = 9  # unknown block mode
    with pytest.raises(pz.FormatError, match="unknown mode"):
        pz.decompress(bad)
    bad = buf.clone()
    bad[coded_begin + 1] = 7  # unknown table form
    with pytest.raises(pz.FormatError, match="frequency table"):
        pz.decompress(bad)
    bad = buf.clone()
    bad[coded_begin + info["coded_bytes"] // info["blocks"] // 2] ^= 0x10  # inside rANS words
    with pytest.raises(pz.FormatError, match="corrupted"):
        pz.decompress(bad)


def test_unsupported_dtype():
    t = torch.zeros(4, dtype=torch.uint8).view(torch.bits8)
    with pytest.raises(TypeError, match="cannot store dtype"):
        pz.compress(t)


def test_max_compressed_size_arguments():
    with pytest.raises(ValueError):
        pz.max_compressed_size(-1, torch.bfloat16)
    with pytest.raises(TypeError):
        pz.max_compressed_size(10, torch.quint8)
    assert pz.max_compressed_size(0, torch.bfloat16) > 0


def test_bad_sm_budget():
    t = torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="max_sms"):
        pz.compress(t, max_sms=0)
    with pytest.raises(ValueError, match="max_sms"):
        pz.decompress(pz.compress(t), max_sms=-2)
    with pytest.raises(ValueError, match="max_sms"):
        with pz.sm_budget(0):
            pass
    with pz.sm_budget(4):  # CPU calls accept and ignore the GPU budget
        assert torch.equal(pz.decompress(pz.compress(t)), t)
        with pz.sm_budget(None):
            assert pz.codec.max_sms_in_force(None) == 0
        assert pz.codec.max_sms_in_force(None) == 4 and pz.codec.max_sms_in_force(2) == 2
    assert pz.codec.max_sms_in_force(None) == 0


# Format v2 integrity: relabelled headers, forged headers, checksums.

def resign(buf: torch.Tensor) -> torch.Tensor:
    """buf with its header checksum recomputed: a forged header that passes the
    header check, so the deeper checks have to catch it."""
    from portable_zip.codec import reference as ref

    ndim = int(buf[7])
    head = bytes(buf[: 32 + 8 * ndim].numpy().tobytes())
    buf = buf.clone()
    buf[28:32] = torch.frombuffer(bytearray(int(ref.header_sum(head)).to_bytes(4, "little")), dtype=torch.uint8)
    return buf


def test_relabel_bf16_fp16():
    rng = fresh_rng()
    for src, dst in ((torch.bfloat16, 2), (torch.float16, 1)):
        buf = pz.compress(weights(rng, 20_000, src)).clone()
        buf[5] = dst
        with pytest.raises(pz.FormatError, match="header checksum"):
            pz.decompress(buf)
        # Even with a forged header checksum, the block checksums (of the
        # elements as the other dtype would join them) do not match.
        with pytest.raises(pz.FormatError, match="checksum"):
            pz.decompress(resign(buf))


def test_relabel_uint8_as_bool():
    t = torch.from_numpy(fresh_rng().integers(0, 256, 5000, dtype=np.uint8))
    t[0] = 7  # at least one byte that is no bool
    buf = pz.compress(t).clone()
    buf[5] = 12
    with pytest.raises(pz.FormatError, match="header checksum"):
        pz.decompress(buf)
    out = torch.zeros(5000, dtype=torch.bool)
    with pytest.raises(pz.FormatError, match="bool"):
        pz.decompress(resign(buf), out=out)
    assert out.view(torch.uint8).max() <= 1  # no invalid bool was produced


def test_relabel_shape_and_sizes():
    buf = pz.compress(weights(fresh_rng(), 20_000, torch.bfloat16).reshape(100, 200))
    for off, val in ((32, 200), (40, 100), (8, int(buf[8]) ^ 16)):  # shape swapped partly; total moved by 16
        bad = buf.clone()
        bad[off] = val
        with pytest.raises(pz.FormatError):
            pz.decompress(bad)
    bad = buf.clone()
    bad[32], bad[40] = 200, 100  # (200, 100): every field valid, only the checksum says no
    with pytest.raises(pz.FormatError, match="header checksum"):
        pz.decompress(bad)


def test_every_header_byte_is_covered():
    """Any change to any header byte (fixed part and shape) raises."""
    rng = fresh_rng()
    for t in (weights(rng, 3000, torch.float32).reshape(3, 1000), torch.arange(70_000, dtype=torch.int32)):
        buf = pz.compress(t)
        ndim = int(buf[7])
        for i in range(32 + 8 * ndim):
            bad = buf.clone()
            bad[i] ^= np.uint8(1 << int(rng.integers(0, 8)))
            with pytest.raises(pz.FormatError):
                pz.decompress(bad)


def test_corrupted_payloads_raise_checksum():
    rng = fresh_rng()
    for t in (weights(rng, 50_000, torch.bfloat16), torch.arange(70_000, dtype=torch.int32)):
        buf = pz.compress(t)
        info = pz.inspect(buf)
        begin = align16(info["header_bytes"])
        bad = buf.clone()
        bad[begin + 777] ^= 1  # a raw-plane (or raw payload) bit: nothing but the checksum sees it
        with pytest.raises(pz.FormatError, match="checksum"):
            pz.decompress(bad)


def test_zero_dim_hides_no_huge_dim():
    """A forged header: shape (0, 2^62) multiplies to 0 = numel, but no tensor
    of that shape exists (torch.empty raises). It must be a FormatError."""
    buf = pz.compress(torch.empty(0, 3, dtype=torch.float16)).clone()
    buf[40:48] = torch.frombuffer(bytearray((1 << 62).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(pz.FormatError, match="shape"):
        pz.decompress(buf)
    with pytest.raises(pz.FormatError, match="shape"):
        pz.decompress(resign(buf))
    # The product of the nonzero dimensions is bounded too (2^48), before any checksum.
    buf = pz.compress(torch.empty(0, 2, 2, dtype=torch.int8)).clone()
    for at in (40, 48):
        buf[at: at + 8] = torch.frombuffer(bytearray((1 << 25).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(pz.FormatError, match="shape"):
        pz.decompress(resign(buf))


def test_v1_header_rules_still_apply():
    """A v1 stream has zeros where v2 keeps the header checksum."""
    from pathlib import Path

    golden = (Path(__file__).resolve().parent / "golden" / "bf16_weights.pz").read_bytes()
    buf = torch.frombuffer(bytearray(golden), dtype=torch.uint8)
    assert pz.inspect(buf)["format_version"] == 1
    bad = buf.clone()
    bad[29] = 1
    with pytest.raises(pz.FormatError, match="parameters"):
        pz.decompress(bad)


@pytest.mark.parametrize("numel", [2**62, 2**48 + 1])
def test_max_compressed_size_overflow(numel):
    with pytest.raises(OverflowError, match="2\\^48"):
        pz.max_compressed_size(numel, torch.float32)
    with pytest.raises(OverflowError, match="2\\^48"):
        pz._C.max_compressed_size(3, numel, [numel])
    assert pz.max_compressed_size(2**48, torch.float32) > 4 * 2**48


# Lazy conj / neg views.

def test_conj_and_neg_views_are_resolved():
    rng = fresh_rng()
    c = torch.from_numpy(rng.standard_normal(1001) + 1j * rng.standard_normal(1001)).to(torch.complex64)
    f = weights(rng, 5001, torch.float32)
    for view, want in ((c.conj(), c.conj().resolve_conj()), (torch._neg_view(f), -f),
                       (torch._neg_view(f.to(torch.bfloat16)), -f.to(torch.bfloat16)),
                       (torch._neg_view(c), -c)):
        assert view.is_conj() or view.is_neg()
        assert same_bits(pz.decompress(pz.compress(view)), want)
        assert same_bits(pz.decompress_batch(pz.compress_batch([view, view]))[1], want)
        out = torch.empty_like(want)
        torch.ops.portable_zip.decompress_into(torch.ops.portable_zip.compress(view), out)
        assert same_bits(out, want)


def test_conj_and_neg_out_rejected():
    rng = fresh_rng()
    c = torch.from_numpy(rng.standard_normal(100) + 1j * rng.standard_normal(100)).to(torch.complex64)
    f = weights(rng, 100, torch.float32)
    for t, out in ((c, torch.empty_like(c).conj()), (f, torch._neg_view(torch.empty_like(f)))):
        buf = pz.compress(t)
        with pytest.raises(ValueError, match="lazy"):
            pz.decompress(buf, out=out)
        with pytest.raises(ValueError, match="lazy"):
            pz.decompress_batch([buf], out=[out])
        with pytest.raises(ValueError, match="lazy"):
            torch.ops.portable_zip.decompress_into(torch.ops.portable_zip.compress(t), out)


# out= overlapping the stream.

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32])
def test_out_overlapping_stream_rejected(dtype):
    t = weights(fresh_rng(), 4000, torch.float32).to(dtype) if dtype.is_floating_point else torch.arange(4000, dtype=dtype)
    buf = pz.compress(t)
    nbytes = t.nbytes
    for shift in (0, 16, buf.numel() - 16, -nbytes + 16):  # out starts inside, at, or just before the stream
        store = torch.zeros(buf.numel() + 2 * nbytes + 64, dtype=torch.uint8)
        at = nbytes + 32
        store[at: at + buf.numel()] = buf
        stream = store[at: at + buf.numel()]
        out = store[at + shift: at + shift + nbytes].view(dtype)
        with pytest.raises(ValueError, match="overlaps"):
            pz.decompress(stream, out=out)
        with pytest.raises(ValueError, match="overlaps"):
            pz.decompress_batch([stream], out=[out])
    # Adjacent but disjoint is fine.
    store = torch.zeros(buf.numel() + nbytes, dtype=torch.uint8)
    store[: buf.numel()] = buf
    out = store[buf.numel():].view(dtype)
    assert same_bits(pz.decompress(store[: buf.numel()], out=out), t)


def test_decompress_batch_outputs_overlapping_other_streams_or_outputs():
    rng = fresh_rng()
    a, b = weights(rng, 1000, torch.bfloat16), weights(rng, 1000, torch.bfloat16)
    ba, bb = pz.compress(a), pz.compress(b)
    store = torch.zeros(bb.numel() + 4096, dtype=torch.uint8)
    store[: bb.numel()] = bb
    with pytest.raises(ValueError, match="overlaps stream 1"):
        pz.decompress_batch([ba, store[: bb.numel()]], out=[store[:2000].view(torch.bfloat16), torch.empty_like(b)])
    shared = torch.empty(1000, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="overlaps out"):
        pz.decompress_batch([ba, bb], out=[shared, shared])


def test_decompress_batch_overlap_messages_name_the_first_pair():
    """The first output (in order) that overlaps anything is named, with the
    lowest stream it overlaps, else the lowest earlier output; an output that
    fails another check first is reported only if no earlier output overlaps."""
    rng = fresh_rng()
    ts = [weights(rng, 1000, torch.bfloat16) for _ in range(4)]
    bufs = [pz.compress(t) for t in ts]
    end = sum(b.numel() for b in bufs) // 2 * 2 + 2  # streams back to back, then room for the outputs
    store = torch.zeros(end + 4 * 2000 + 4000, dtype=torch.uint8)
    streams, at = [], 0
    for b in bufs:
        streams.append(store[at: at + b.numel()])
        streams[-1].copy_(b)
        at += b.numel()
    room = [store[end + k * 2000: end + (k + 1) * 2000].view(torch.bfloat16) for k in range(4)]

    def err(outs):
        with pytest.raises(ValueError) as e:
            pz.decompress_batch(streams, out=outs)
        return str(e.value)

    first = [s.data_ptr() - store.data_ptr() for s in streams]
    into_stream = [store[a // 2 * 2 + 2: a // 2 * 2 + 2002].view(torch.bfloat16) for a in first]
    assert err([room[0], into_stream[3], room[2], into_stream[0]]) == "out[1] overlaps stream 3's memory"
    assert err([room[0], room[1], into_stream[2], room[3]]) == "out[2] overlaps stream 2's memory"
    assert err([room[0], room[1], room[0], room[1]]) == "out[2] overlaps out[0]"
    assert err([room[2], room[1], room[3], room[3][1:]]) == "out[3] overlaps out[2]"
    assert err([into_stream[1], room[1], room[2], into_stream[1]]) == "out[0] overlaps stream 1's memory"
    # The last stream's last bytes and out[0]'s first: the stream is named.
    straddle = store[end - 4: end + 1996].view(torch.bfloat16)
    assert err([room[0], room[1], room[2], straddle]) == "out[3] overlaps stream 3's memory"
    bad = torch.empty(2000, dtype=torch.bfloat16)[::2]
    assert err([room[0], into_stream[0], bad, into_stream[1]]) == "out[1] overlaps stream 0's memory"
    assert "out[1] must be contiguous" in err([room[0], bad, into_stream[2], into_stream[3]])
    assert err([room[0], None, room[0][5:], None]) == "out[2] overlaps out[0]"
    with pytest.raises(ValueError, match="out overlaps the stream's memory"):
        pz.decompress(streams[0], out=into_stream[0])
    # Accepted: adjacent outputs, empty outputs inside streams, one stream decoded twice.
    got = pz.decompress_batch(streams, out=[store[-4000:-2000].view(torch.bfloat16),
                                            store[-2000:].view(torch.bfloat16), room[0], room[1]])
    assert all(same_bits(g, t) for g, t in zip(got, [ts[0], ts[1], ts[2], ts[3]]))
    empty = store[10:10].view(torch.bfloat16)
    assert pz.decompress_batch([pz.compress(ts[0][:0]), streams[0]], out=[empty, room[2]])[0].numel() == 0
    twice = pz.decompress_batch([streams[2], streams[2]], out=[room[0], room[1]])
    assert same_bits(twice[0], ts[2]) and same_bits(twice[1], ts[2])


def _pairwise_error(bufs, outs):
    """The rule decompress_batch keeps, written the slow way: every output
    against every stream, then every earlier output."""
    def overlap(a, b):
        return (a.nbytes and b.nbytes and a.data_ptr() < b.data_ptr() + b.nbytes
                and b.data_ptr() < a.data_ptr() + a.nbytes)
    for i, o in enumerate(outs):
        if o is None:
            continue
        for j, b in enumerate(bufs):
            if overlap(o, b):
                return f"out[{i}] overlaps stream {j}'s memory"
        for j in range(i):
            if outs[j] is not None and overlap(o, outs[j]):
                return f"out[{i}] overlaps out[{j}]"
    return None


def test_decompress_batch_overlap_check_matches_pairwise_rule():
    """Random layouts of streams and outputs in two buffers (touching,
    nested, empty, repeated spans; streams that share bytes): the sorted scan
    accepts exactly what the pairwise rule accepts and names the same pair.
    Validation only (the streams are not real): codec._check_outs."""
    rng = fresh_rng()
    stores = [torch.zeros(512, dtype=torch.uint8), torch.zeros(512, dtype=torch.uint8)]

    def span(kind):
        s = stores[int(rng.integers(0, 2))]
        at = int(rng.integers(0, 8)) * 64 if kind == "grid" else int(rng.integers(0, 500))
        n = 64 if kind == "grid" else int(rng.integers(0, 12 if rng.integers(0, 4) else 64))
        return s[at: at + n]

    seen = {"ok": 0, "stream": 0, "out": 0}
    for trial in range(3000):
        kind = "grid" if trial % 2 else "any"  # grid: 64-byte cells, so spans often touch or coincide
        bufs = [span(kind) for _ in range(int(rng.integers(1, 9)))]
        outs = [None if rng.integers(0, 6) == 0 else span(kind) for _ in bufs]
        want = _pairwise_error(bufs, outs)
        if want is None:
            pz.codec.streams._check_outs(bufs, outs)
            seen["ok"] += 1
        else:
            with pytest.raises(ValueError) as e:
                pz.codec.streams._check_outs(bufs, outs)
            assert str(e.value) == want, (trial, [(b.data_ptr(), b.nbytes) for b in bufs],
                                          [o if o is None else (o.data_ptr(), o.nbytes) for o in outs])
            seen["stream" if "stream" in want else "out"] += 1
    assert min(seen.values()) > 100, seen  # every outcome drawn often


def test_size_field():
    """size_field: the 8-byte view holding the stream's size, at the offset
    the binding gives, for trimmed and padded buffers; short or wrong buffers
    are rejected."""
    t = weights(fresh_rng(), 5000, torch.bfloat16)
    buf = pz.compress(t)
    padded = pz.compress(t, trim=False)
    for b in (buf, padded):
        f = pz.codec.size_field(b)
        assert f.dtype == torch.uint8 and f.numel() == 8
        assert f.data_ptr() == b.data_ptr() + pz._C.total_bytes_offset  # a view: no copy, no sync
        assert int.from_bytes(f.numpy().tobytes(), "little") == buf.numel() == pz.compressed_size(b)
    with pytest.raises(ValueError, match="too short"):
        pz.codec.size_field(buf[: pz._C.total_bytes_offset + 7])
    with pytest.raises(TypeError, match="uint8"):
        pz.codec.size_field(t)


def test_zeroed_data_and_checksum_raise():
    """A region zeroed together with its checksum (found by the fuzzer: a bool
    [1] stream whose payload and chunk checksum were set to 0 decoded to
    False). A one-element bf16 block the same way: plane byte, stored symbol
    and block checksum all zero would decode to 0.0."""
    for t in (torch.tensor([True]), torch.tensor([7], dtype=torch.uint8), torch.tensor([1.5], dtype=torch.bfloat16)):
        buf = pz.compress(t).clone()
        info = pz.inspect(buf)
        begin = align16(info["header_bytes"])
        bad = buf.clone()
        bad[begin: begin + t.nbytes] = 0  # the payload, or the raw plane
        bad[-4 if info["codec"] == "raw" else begin + 16 + 8: None if info["codec"] == "raw" else begin + 16 + 12] = 0
        if info["codec"] != "raw":
            bad[buf.numel() - 16 + 1] = 0  # the stored symbol (mode 0 segment, the stream's last 16 bytes)
        assert not torch.equal(bad, buf)
        with pytest.raises(pz.FormatError, match="checksum"):
            pz.decompress(bad)


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, 2**31, 2**64, "4"])
def test_bad_thread_count_rejected(threads):
    """Every public codec function taking threads: a ValueError naming it, never the binding's argument dump."""
    t = torch.randn(1000).to(torch.bfloat16)
    buf = pz.compress(t)
    for call in (lambda: pz.compress(t, threads=threads), lambda: pz.decompress(buf, threads=threads),
                 lambda: pz.compress_batch([t], threads=threads), lambda: pz.decompress_batch([buf], threads=threads),
                 lambda: pz.decompress_batch([buf], out=[torch.empty_like(t)], threads=threads)):
        with pytest.raises(ValueError, match=r"^threads must be a positive int \(at most 2147483647\)"):
            call()
    assert torch.equal(pz.decompress(pz.compress(t, threads=2**31 - 1), threads=np.int64(3)), t)


@pytest.mark.parametrize("max_sms", [0, 2**31, "4", 1.5])
def test_bad_max_sms_rejected(max_sms):
    t = torch.randn(100).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^max_sms must be a positive int"):
        pz.compress(t, max_sms=max_sms)
    with pytest.raises(ValueError, match=r"^max_sms must be a positive int"):
        with pz.sm_budget(max_sms):
            pass


def _bad_batch(n: int, bad: tuple, rng):
    ts = [torch.from_numpy(rng.standard_normal(int(rng.integers(1, 3000))).astype(np.float32)).to(torch.bfloat16)
          for _ in range(n)]
    bufs = [pz.compress(t) for t in ts]
    for i in bad:
        bufs[i] = bufs[i].clone()
        bufs[i][40:] ^= 0x5A  # every byte past the 1-D header: the payload checks catch it
    return ts, bufs


@pytest.mark.parametrize("with_out", [True, False])
def test_decompress_batch_names_every_failed_stream_and_decodes_the_rest(with_out):
    rng = fresh_rng()
    n = 9
    bad = tuple(sorted(rng.choice(n, size=2, replace=False).tolist()))
    ts, bufs = _bad_batch(n, bad, rng)
    bufs[bad[1]] = bufs[bad[1]][:20]  # one cut short: its header fails
    outs = [torch.full_like(t, 7) for t in ts] if with_out else None
    with pytest.raises(pz.FormatError) as e:
        pz.decompress_batch(bufs, out=outs)
    a, b = bad
    msg = str(e.value)
    assert msg.startswith(f"decompress_batch: streams {a}, {b} failed (stream {a}: "), msg
    assert f"stream {b}: stream is shorter than the fixed 32-byte header" in msg, msg
    assert msg.endswith(f"the outputs of the other streams hold their decoded data, outputs {a}, {b} are "
                        "unspecified"), msg
    assert e.value.streams == [a, b]
    if with_out:
        for i, (o, t) in enumerate(zip(outs, ts)):
            assert same_bits(o, t) == (i not in bad), i


def test_decompress_batch_bad_out_raises_before_any_decode():
    """An output that does not fit its stream is an argument error: nothing is written."""
    rng = fresh_rng()
    ts, bufs = _bad_batch(4, (), rng)
    outs = [torch.full_like(t, 7) for t in ts]
    outs[2] = torch.empty(ts[2].numel() + 1, dtype=ts[2].dtype)
    with pytest.raises(ValueError, match=r"^out\[2\] is torch.bfloat16\[\d+\] but stream 2 holds"):
        pz.decompress_batch(bufs, out=outs)
    assert all(bool((o == 7).all()) for i, o in enumerate(outs) if i != 2)


def test_one_failed_stream_is_named():
    ts, bufs = _bad_batch(3, (1,), fresh_rng())
    with pytest.raises(pz.FormatError, match=r"^decompress_batch: stream 1 failed \(stream 1: .*output 1 is "
                                             r"unspecified$"):
        pz.decompress_batch(bufs)


@pytest.mark.parametrize("field,value,shown", [("link_gbps", "fast", "'fast'"), ("latency_us", -1, "-1"),
                                               ("codec_gbps", 0, "0"), ("margin", 1.0, "1.0"),
                                               ("timeout", -5, "-5"), ("max_sms", 0, "0")])
def test_backend_options_name_the_bad_field(field, value, shown):
    from portable_zip.c10d import Options
    with pytest.raises(ValueError, match=rf"^Options\.{field} must be .*got {shown}$"):
        Options(**{field: value})


def test_cpu_decodes_check_before_returning():
    """CPU decodes raise at once (pz.check() has nothing to wait for), in
    decompress and in decompress_batch, which names the failing stream."""
    good = stream()
    bad = good.clone()
    bad[-20] ^= 0x10
    pz.check()
    assert pz.codec.checks.pending() == 0
    with pytest.raises(pz.FormatError, match="corrupted stream"):
        pz.decompress(bad, check=True)
    with pytest.raises(pz.FormatError):
        pz.decompress_batch([good, bad])
    out = pz.decompress(good)
    with pytest.raises(ValueError, match="but the stream holds"):
        pz.decompress(good, out=torch.empty(out.numel() + 1, dtype=out.dtype))
    with pytest.raises(ValueError, match="2 streams but 1 outputs"):
        pz.decompress_batch([good, good], out=[out])
    assert pz.decompress_batch([good, good], out=[out, torch.empty_like(out)])[0] is out
    pz.check()


def one_block_stream(seg: bytes, lanes: int = 32) -> torch.Tensor:
    """A one-block bf16 stream (4096 elements, `lanes` rANS lanes) whose only
    segment is seg, ending the buffer, with the offsets, total and header
    checksum to match."""
    with forced_plan(12, lanes):
        buf = pz.compress(weights(fresh_rng(), 4096, torch.bfloat16))
    info = pz.inspect(buf)
    assert info["blocks"] == 1 and info["codec"] == "rans"
    raw_end = (info["header_bytes"] + 15) // 16 * 16 + 4096
    offsets = (raw_end + 15) // 16 * 16
    coded = info["compressed_bytes"] - info["coded_bytes"]
    out = bytearray(buf[:coded].numpy().tobytes()) + seg
    out[offsets: offsets + 8] = len(seg).to_bytes(8, "little")
    out[8:16] = len(out).to_bytes(8, "little")
    return resign(torch.frombuffer(out, dtype=torch.uint8).clone())


# A rANS segment's table: symbols 0 and 1, frequency 2048 each.
TWO_SYMBOLS = bytes([1, 0, 0, 1, 0x88, 0x00, 0x88, 0x00])


def words_run_out_stream(lanes: int = 32) -> torch.Tensor:
    """A one-block bf16 stream whose rANS segment holds no coded words but
    needs them at once (states 2^16, two symbols of frequency 2048: the first
    step renormalizes every lane), and ends the buffer: a decoder that reads
    words it does not have reads past the stream."""
    seg = TWO_SYMBOLS + (0).to_bytes(4, "little") + (1 << 16).to_bytes(4, "little") * lanes
    return one_block_stream(seg + bytes(-len(seg) % 16), lanes)


def words_at_end_stream(lanes: int = 32) -> torch.Tensor:
    """A one-block bf16 stream whose rANS segment ends the buffer exactly (514
    words: 12 + 4 x lanes + 1028 bytes, no padding) and whose states (all
    2^32 - 1) need no word for their first 16 steps: a decoder that loads a
    word for lanes that need none, at the word position, reads the 2 bytes
    past the stream."""
    words = 514
    seg = TWO_SYMBOLS + words.to_bytes(4, "little") + (2**32 - 1).to_bytes(4, "little") * lanes
    seg += bytes(fresh_rng().integers(0, 256, 2 * words, dtype=np.uint8))
    assert len(seg) % 16 == 0
    return one_block_stream(seg, lanes)


@pytest.mark.parametrize("lanes", [32, 64])
def test_words_at_end(lanes):
    with pytest.raises(pz.FormatError):
        pz.decompress(words_at_end_stream(lanes))


@pytest.mark.parametrize("lanes", [32, 64])
def test_words_run_out(lanes):
    with pytest.raises(pz.FormatError, match="coded data is inconsistent"):
        pz.decompress(words_run_out_stream(lanes))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and pz.backend_info()["backend"] in ("cuda", "hip")),
                    reason="needs a GPU build and a GPU")
@pytest.mark.parametrize("with_out", [True, False])
def test_decompress_batch_gpu_names_every_failed_stream_and_decodes_the_rest(with_out):
    """The GPU path alike: one launch decodes the batch; check=True (or no
    out=) reports every failed stream at once, and the others hold their data."""
    rng = fresh_rng()
    n = 7
    bad = tuple(sorted(rng.choice(n, size=2, replace=False).tolist()))
    ts, bufs = _bad_batch(n, bad, rng)
    ts, bufs = [t.cuda() for t in ts], [b.cuda() for b in bufs]
    outs = [torch.full_like(t, 7) for t in ts] if with_out else None
    with pytest.raises(pz.FormatError) as e:
        pz.decompress_batch(bufs, out=outs, check=True)
    a, b = bad
    assert str(e.value).startswith(f"decompress_batch: streams {a}, {b} failed (stream {a}: "), str(e.value)
    assert e.value.streams == [a, b]
    if with_out:
        for i, (o, t) in enumerate(zip(outs, ts)):
            if i not in bad:
                assert same_bits(o, t), i
