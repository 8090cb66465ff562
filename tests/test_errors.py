"""Bad input gets a clear error, never a crash."""
import pytest
import torch

import portable_zip as pz
from conftest import fresh_rng, weights


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
    buf[4] = 3
    with pytest.raises(pz.FormatError, match="version 3; this build reads versions 1 to 2"):
        pz.decompress(buf)


@pytest.mark.parametrize("offset,value,msg", [
    (5, 0, "dtype"), (5, 200, "dtype"), (6, 7, "codec"), (7, 17, "ndim"), (24, 3, "parameters"),
    (25, 11, "parameters"), (26, 64, "parameters"), (27, 1, "parameters"), (32, 7, "shape"),
    (slice(8, 16), 0, "total"), (15, 1, "total"), (slice(8, 16), 0xFF, "total"),
])
def test_header_fields(offset, value, msg):
    buf = stream().clone()
    buf[offset] = value
    with pytest.raises(pz.FormatError, match=msg):
        pz.decompress(buf)


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
            assert pz.codec._max_sms(None) == 0
        assert pz.codec._max_sms(None) == 4 and pz.codec._max_sms(2) == 2
    assert pz.codec._max_sms(None) == 0
