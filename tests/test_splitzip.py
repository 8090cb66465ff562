"""SplitZip's idea as written in bench/pzbench/splitzip.py (the comparison
codec of bench/kv_ratio.py): exact round trips on every bf16 bit pattern and
on fresh random data, and the stream's size."""
import os
import sys

import numpy as np
import pytest
import torch

from conftest import fresh_rng

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from pzbench import splitzip as sz  # noqa: E402

ALL = np.arange(65536, dtype=np.uint16)  # every bf16 pattern: +-0, subnormals, normals, +-inf, every NaN


def roundtrip(bits, **kw) -> np.ndarray:
    buf = sz.encode(bits, **kw)
    got = sz.decode(buf)
    assert got.dtype == np.uint16 and np.array_equal(got, bits.reshape(-1))
    return buf


def expected_size(bits: np.ndarray, table: np.ndarray) -> int:
    exp = (bits >> 7) & 0xFF
    escapes = int(np.count_nonzero(~np.isin(exp, table)))
    return sz.HEADER.size + (bits.size + 1) // 2 + bits.size + escapes


@pytest.mark.parametrize("table", [None, "low", "specials"])
def test_every_bf16_pattern(table):
    tab = {None: None, "low": np.arange(15), "specials": np.array([0, 255, *range(120, 133)])}[table]
    buf = roundtrip(ALL, table=tab)
    used = sz.HEADER.unpack(buf[:sz.HEADER.size].tobytes())[3]
    assert buf.size == expected_size(ALL, np.frombuffer(used, np.uint8))
    # shuffled, so escapes and codes mix in every pair position
    roundtrip(fresh_rng().permutation(ALL), table=tab)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4097, 100_001])
def test_random_bits(n):
    rng = fresh_rng()
    bits = rng.integers(0, 65536, n, dtype=np.uint16)
    buf = roundtrip(bits)
    used = np.frombuffer(sz.HEADER.unpack(buf[:sz.HEADER.size].tobytes())[3], np.uint8)
    assert buf.size == expected_size(bits, used)


def test_weights_like_values():
    rng = fresh_rng()
    t = torch.from_numpy(rng.standard_normal(300_001, dtype=np.float32) * 0.02).to(torch.bfloat16)
    t[::997] = float("nan")
    t[1::991] = float("inf")
    t[2::983] = -0.0
    t[3::977] = 1e-40  # subnormal in bf16
    bits = sz.bits_of(t)
    buf = roundtrip(bits, sample=1)
    # a full count puts the 15 most frequent exponents in the table: the size formula is the stream
    exact = sz.size_formula((bits >> 7) & 0xFF, 8, 8) * 2 * bits.size
    assert abs(buf.size - sz.HEADER.size - exact) <= 1
    assert 0.75 <= sz.ratio(buf, bits.size) < 0.77
    back = torch.from_numpy(sz.decode(buf).view(np.int16)).view(torch.bfloat16)
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


def test_bad_streams():
    buf = sz.encode(fresh_rng().integers(0, 65536, 1001, dtype=np.uint16))
    with pytest.raises(ValueError):
        sz.decode(buf[:-1])
    bad = buf.copy()
    bad[0] ^= 0xFF
    with pytest.raises(ValueError):
        sz.decode(bad)
    with pytest.raises(ValueError):
        sz.encode(ALL, table=np.zeros(15, np.uint8))


def test_real_kv_if_prepared():
    from pzbench import real_kv

    if real_kv.missing():
        pytest.skip(real_kv.missing())
    kv, _ = real_kv.load("bf16")
    roundtrip(sz.bits_of(kv[:4]))
