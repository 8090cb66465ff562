"""SplitZip's idea for bf16, written here in numpy (vectorised, single thread):
the 15 most frequent exponents get a fixed 4-bit code each; any other
exponent is written as the escape code 15 in the code stream and its raw
exponent byte goes, in element order, to a separate escape stream. Sign and
mantissa (8 bits) are stored raw. No entropy coder: a value costs 4 + 8 bits,
plus 8 more where it escapes, so the ratio is at least 0.75 (headers aside).

Stream (little endian):

    header   "SZ1" + 1 byte version, u64 elements, u64 escapes, 15 table bytes, 1 pad byte  (36 bytes)
    codes    ceil(n / 2) bytes: element 2i's code in the low nibble, 2i+1's in the high one
             (an odd n pads the last high nibble with code 0)
    sm       n bytes: sign << 7 | 7 mantissa bits
    escapes  one raw exponent byte per element coded 15, in element order

The table is the 15 most frequent exponents of the tensor, counted on every
`sample`-th element (default 16; 1 counts all), or a table passed in
(calibrated elsewhere). Any table round-trips exactly: what it leaves out
escapes. NaN, inf, subnormals and -0.0 are plain bit patterns here (exponent
255 or 0 is coded or escapes like any other).

    python -P bench/pzbench/splitzip.py      # round-trip checks and GB/s on random bf16
"""
from __future__ import annotations

import struct
import sys
import time
from typing import Optional

import numpy as np

MAGIC = b"SZ1\x01"
HEADER = struct.Struct("<4sQQ15sx")
ESC = 15


def bits_of(x) -> np.ndarray:
    """uint16 bit patterns of a bf16 torch tensor (or a uint16/int16 numpy array), flat."""
    if isinstance(x, np.ndarray):
        return x.reshape(-1).view(np.uint16)
    import torch

    if x.dtype != torch.bfloat16:
        raise TypeError(f"SplitZip here codes bf16, not {x.dtype}")
    return x.detach().reshape(-1).cpu().view(torch.int16).numpy().view(np.uint16)


def top15(bits: np.ndarray, sample: int = 16) -> np.ndarray:
    """The 15 most frequent exponents (most frequent first; ties by value) of every sample-th element."""
    e = (bits[::sample] >> 7).astype(np.uint8)
    counts = np.bincount(e, minlength=256)
    order = np.lexsort((np.arange(256), -counts))
    return order[:15].astype(np.uint8)


def encode(x, table: Optional[np.ndarray] = None, sample: int = 16) -> np.ndarray:
    """A bf16 tensor (torch, or uint16 bits) as one SplitZip stream (uint8 array)."""
    bits = bits_of(x)
    n = bits.size
    tab = top15(bits, sample) if table is None else np.asarray(table, np.uint8)
    if tab.size != 15 or np.unique(tab).size != 15:
        raise ValueError("the table needs 15 distinct exponents")
    code = np.full(256, ESC, np.uint8)
    code[tab] = np.arange(15, dtype=np.uint8)
    n2 = (n + 1) // 2
    exp = np.empty(2 * n2, np.uint8)  # padded to pairs
    np.right_shift(bits, 7, out=exp[:n], casting="unsafe")  # the sign falls off the byte
    if n & 1:
        exp[n] = tab[0]  # the pad codes as 0, never as an escape
    packed = _pair_table(code)[exp.view(np.uint16)]  # (exp0 | exp1 << 8) -> code0 | code1 << 4
    idx, sel = _escaped(packed)
    escapes = exp.reshape(-1, 2)[idx][sel]
    out = np.empty(HEADER.size + n2 + n + escapes.size, np.uint8)
    out[:HEADER.size] = np.frombuffer(HEADER.pack(MAGIC, n, escapes.size, tab.tobytes()), np.uint8)
    p = HEADER.size
    out[p:p + n2] = packed
    p += n2
    sm = bits & 0x807F  # sign << 15 | mantissa
    sm |= sm >> 8  # sign down to bit 7
    np.copyto(out[p:p + n], sm, casting="unsafe")
    out[p + n:] = escapes
    return out


def decode(buf: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """uint16 bf16 bit patterns of a SplitZip stream (into out when given)."""
    buf = np.asarray(buf, np.uint8).reshape(-1)
    magic, n, n_esc, tab = HEADER.unpack(buf[:HEADER.size].tobytes())
    if magic != MAGIC:
        raise ValueError("not a SplitZip stream")
    n2 = (n + 1) // 2
    if buf.size != HEADER.size + n2 + n + n_esc:
        raise ValueError(f"stream of {buf.size} bytes, header says {HEADER.size + n2 + n + n_esc}")
    packed = buf[HEADER.size:HEADER.size + n2]
    sm = buf[HEADER.size + n2:HEADER.size + n2 + n]
    escapes = buf[HEADER.size + n2 + n:]
    dec = np.zeros(16, np.uint32)
    dec[:15] = np.frombuffer(tab, np.uint8)
    b = np.arange(256)
    byte_pair = (dec[b & 15] << 7) | (dec[b >> 4] << 23)  # packed byte -> two exponents, in place in two uint16s
    full = byte_pair.astype(np.uint32)[packed].view(np.uint16)
    if n_esc:
        idx, sel = _escaped(packed)
        pos = (2 * idx[:, None] + np.array([0, 1]))[sel]
        if pos.size != n_esc:
            raise ValueError(f"{pos.size} escape codes, header says {n_esc}")
        full[pos] = escapes.astype(np.uint16) << 7
    o = full[:n]
    s = sm.astype(np.uint16)
    s <<= 8
    s &= 0x8000
    o |= s
    o |= sm & 0x7F
    if out is None:
        return o
    out.reshape(-1)[:] = o
    return out


def _escaped(packed: np.ndarray):
    """(pairs holding an escape code, [k, 2] which of their two elements escape)."""
    idx = np.flatnonzero(((packed & 15) == ESC) | (packed >= ESC << 4))
    p = packed[idx]
    return idx, np.stack([(p & 15) == ESC, (p >> 4) == ESC], 1)


def ratio(buf: np.ndarray, n: int) -> float:
    """Stream bytes over the n bf16 values' 2n bytes."""
    return buf.size / (2 * n)


_pair_cache: dict = {}


def _pair_table(code: np.ndarray) -> np.ndarray:
    key = code.tobytes()
    if key not in _pair_cache:
        c = code.astype(np.uint8)
        _pair_cache.clear()
        _pair_cache[key] = (c[np.arange(65536) & 255] | (c[np.arange(65536) >> 8] << 4)).astype(np.uint8)
    return _pair_cache[key]


def size_formula(exp_bits: np.ndarray, exp_width: int, raw_bits: int) -> float:
    """SplitZip's size for any float format, from its exponent field values: (4 code bits +
    raw_bits (sign and mantissa) + 8 bits per escape) over the element's exp_width + raw_bits
    bits, headers aside.
    For fp8 e4m3 (4-bit exponent, 4 raw bits) this is >= 1.0; e5m2 (5 and 3) >= 0.875."""
    counts = np.bincount(np.asarray(exp_bits, np.int64).reshape(-1), minlength=1 << exp_width)
    esc = counts.sum() - np.sort(counts)[::-1][:15].sum()
    n = counts.sum()
    return float((n * (4 + raw_bits) + 8 * esc) / (n * (exp_width + raw_bits)))


def timed(fn, reps: int = 5) -> float:
    """Median CPU seconds of this thread over fn() calls, after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    return float(np.median(ts))


def main() -> int:
    rng = np.random.default_rng(0)
    # every bit pattern, then random bits, then bf16 N(0, 1)-like values
    cases = {"all 65536 patterns": np.arange(65536, dtype=np.uint16),
             "random bits (odd n)": rng.integers(0, 65536, 1_000_001, dtype=np.uint16),
             "N(0,1)": (rng.standard_normal(1 << 24).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)}
    for name, bits in cases.items():
        buf = encode(bits)
        assert np.array_equal(decode(buf), bits), name
        print(f"{name}: {bits.size:,} values, ratio {ratio(buf, bits.size):.4f}, round trip exact")
    bits = cases["N(0,1)"]
    buf = encode(bits)
    te, td = timed(lambda: encode(bits)), timed(lambda: decode(buf))
    print(f"N(0,1) 32 MiB: encode {bits.nbytes / te / 1e9:.2f} GB/s, decode {bits.nbytes / td / 1e9:.2f} GB/s (one thread, CPU time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
