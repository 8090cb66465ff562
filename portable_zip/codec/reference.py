"""A small pure-numpy implementation of format v4 (docs/FORMAT.md); it also
reads v3 streams (always 32 lanes), v2 streams (per-symbol block checksums,
lane = j mod 32) and v1 streams (no checksums).

Written from the format description, independently of the C++ code, so tests
can check the fast paths byte for byte against it. Slow: for small inputs.
"""
from __future__ import annotations

import numpy as np

from .dtypes import CODED as _CODED_DTYPES, code_of

MAGIC = b"PZIP"
VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
RAW_CHUNK = 1 << 16  # bytes of raw payload per checksum
LANES = 32
WIDE_LANES = 64  # v4: rANS blocks of 2^WIDE_LOG2 symbols
WIDE_LOG2 = 15
WIDE_MIN_SYMBOLS = 1 << 27
PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
STATE_LOW = 1 << 16
ALIGN = 16

BF16, FP16, FP32, E4M3, E5M2 = 1, 2, 3, 4, 5
CODED = frozenset(code_of(d) for d in _CODED_DTYPES)  # format dtype codes of _dtypes.CODED
ELEM = {1: 2, 2: 2, 3: 4, 4: 1, 5: 1, 6: 8, 7: 1, 8: 1, 9: 2, 10: 4, 11: 8, 12: 1, 13: 8, 14: 16,
        15: 1, 16: 1, 17: 2, 18: 4, 19: 8, 20: 4, 21: 1}


def align(v: int, a: int = ALIGN) -> int:
    return (v + a - 1) // a * a


def checksum(units: np.ndarray, first: int) -> int:
    """0x505A4932 plus the sum mod 2^32 of fmix32(unit ^ index * 0x9E3779B9)
    over units (u32), the first at index `first` (indices taken mod 2^32)."""
    with np.errstate(over="ignore"):
        idx = (np.arange(units.size, dtype=np.uint64) + np.uint64(first)).astype(np.uint32)
        t = units.astype(np.uint32) ^ (idx * np.uint32(0x9E3779B9))
        t ^= t >> np.uint32(16)
        t *= np.uint32(0x85EBCA6B)
        t ^= t >> np.uint32(13)
        t *= np.uint32(0xC2B2AE35)
        t ^= t >> np.uint32(16)
    return (int(t.sum(dtype=np.uint64)) + 0x505A4932) & 0xFFFFFFFF


def words_of(data: bytes) -> np.ndarray:
    """32-bit little-endian words of data, a partial last word padded with zeros."""
    return np.frombuffer(data + bytes(-len(data) % 4), "<u4")


def chunk_sums(units: np.ndarray, per: int) -> list:
    """Checksum of each run of `per` units, indices counted from the first unit."""
    return [checksum(units[k: k + per], k) for k in range(0, units.size, per)]


def units_of(dtype: int, data: np.ndarray) -> np.ndarray:
    """v2 units: each symbol's element bytes as one little-endian integer (fp8: a pair, an odd last
    element paired with 0)."""
    if dtype == FP32:
        return data.view("<u4")
    if dtype in (E4M3, E5M2) and data.size % 2:
        data = np.concatenate([data, np.zeros(1, np.uint8)])
    return data.view("<u2")


def raw_sums(payload: bytes) -> bytes:
    return np.array(chunk_sums(words_of(payload), RAW_CHUNK // 4), "<u4").tobytes()


def block_sums(dtype: int, data: bytes, lg: int, version: int) -> list:
    """Checksum of each block of 2^lg symbols over the tensor's bytes. v3: 32-bit words, S bytes per
    symbol; a block start is a multiple of 2^10 symbols, so blocks start on a word and never share one.
    v2: one unit per symbol."""
    if version >= 3:
        return chunk_sums(words_of(data), ((4 if dtype == FP32 else 2) << lg) // 4)
    return chunk_sums(units_of(dtype, np.frombuffer(data, np.uint8)), 1 << lg)


def header_sum(h: bytes) -> int:
    words = np.frombuffer(h, "<u4").copy()
    words[7] = 0
    return checksum(words, 0)


def nsym_of(dtype: int, numel: int) -> int:
    return (numel + 1) // 2 if dtype in (E4M3, E5M2) else numel


def block_log2_of(nsym: int, wide: bool) -> int:
    """2^12 symbols; 2^13 once 512 such blocks fit, 2^14 once 2048 do; where 64 lanes are allowed
    (wide), 2^15 from 2^27 symbols on (format.h choose_block_log2)."""
    if wide and nsym >= WIDE_MIN_SYMBOLS:
        return WIDE_LOG2
    return 14 if nsym >> 14 >= 2048 else 13 if nsym >> 13 >= 512 else 12


def split(dtype: int, data: np.ndarray):
    """uint8 bytes -> (symbols, plane8, plane16 or None)."""
    if dtype == BF16:
        w = data.view("<u2").astype(np.uint32)
        return (w >> 7 & 0xFF).astype(np.uint8), ((w >> 8 & 0x80) | (w & 0x7F)).astype(np.uint8), None
    if dtype == FP16:
        w = data.view("<u2").astype(np.uint32)
        return (w >> 8).astype(np.uint8), (w & 0xFF).astype(np.uint8), None
    if dtype == FP32:
        w = data.view("<u4").astype(np.uint64)
        return ((w >> 23) & 0xFF).astype(np.uint8), ((w >> 24 & 0x80) | (w >> 16 & 0x7F)).astype(np.uint8), \
            (w & 0xFFFF).astype(np.uint16)
    x = np.zeros(2 * nsym_of(dtype, data.size), np.uint8)
    x[: data.size] = data
    code, nib = (x >> 3) & 0xF, ((x >> 4) & 0x8) | (x & 0x7)
    return (code[0::2] | code[1::2] << 4).astype(np.uint8), (nib[0::2] | nib[1::2] << 4).astype(np.uint8), None


def join(dtype: int, numel: int, sym: np.ndarray, p8: np.ndarray, p16) -> bytes:
    s, r = sym.astype(np.uint32), p8.astype(np.uint32)
    if dtype == BF16:
        return ((r & 0x80) << 8 | s << 7 | (r & 0x7F)).astype("<u2").tobytes()
    if dtype == FP16:
        return (s << 8 | r).astype("<u2").tobytes()
    if dtype == FP32:
        return ((r & 0x80) << 24 | s << 23 | (r & 0x7F) << 16 | p16.astype(np.uint32)).astype("<u4").tobytes()
    out = np.empty(2 * s.size, np.uint32)
    for half in (0, 1):
        c, n = (s >> 4 * half) & 0xF, (r >> 4 * half) & 0xF
        out[half::2] = (n & 8) << 4 | c << 3 | (n & 7)
    return out.astype(np.uint8)[:numel].tobytes()


def quantize(hist: np.ndarray, n: int) -> list:
    freq = [0] * 256
    total, best, best_c = 0, 0, 0
    for s in range(256):
        c = int(hist[s])
        if c:
            freq[s] = max(1, (c * PROB_SCALE + n // 2) // n)
            if c > best_c:
                best, best_c = s, c
        total += freq[s]
    d = PROB_SCALE - total
    if d > 0:
        freq[best] += d
    while d < 0:
        top = max(range(256), key=lambda s: (freq[s], -s))
        take = min(-d, freq[top] - 1)
        freq[top] -= take
        d += take
    return freq


def varint(f: int) -> bytes:
    return bytes([f]) if f < 128 else bytes([0x80 | f >> 8, f & 0xFF])


def table_bytes(freq: list) -> bytes:
    present = [s for s in range(256) if freq[s]]
    lo, hi = present[0], present[-1]
    rng = bytes([0, lo, hi]) + b"".join(varint(freq[s]) for s in range(lo, hi + 1))
    bm = bytearray(32)
    for s in present:
        bm[s >> 3] |= 1 << (s & 7)
    bitmap = bytes([1]) + bytes(bm) + b"".join(varint(freq[s]) for s in present)
    return rng if len(rng) <= len(bitmap) else bitmap


def lane_steps(n: int, version: int, lanes: int = LANES) -> np.ndarray:
    """[step, lane] -> index of the block symbol that lane codes at that step, -1 where it has none.
    v3/v4: rows of 8 * lanes symbols, lane L owns symbols 8L..8L+7 of each row (its own 16 bytes on a
    GPU); v1/v2: symbol j in lane j mod 32, step j div 32."""
    if version >= 3:
        row = 8 * lanes
        step = np.arange(8 * -(-n // row))[:, None]
        j = row * (step // 8) + 8 * np.arange(lanes) + step % 8
    else:
        j = np.arange(-(-n // LANES) * LANES).reshape(-1, LANES)
    return np.where(j < n, j, -1)


def encode_block(sym: np.ndarray, version: int = VERSION, lanes: int = LANES) -> bytes:
    n = sym.size
    freq = quantize(np.bincount(sym, minlength=256), n)
    table = table_bytes(freq)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint64)
    f_arr = np.array(freq, np.uint64)
    wpos = align(1 + len(table), 4)
    prefix = wpos + 4 + 4 * lanes
    stored = prefix >= 1 + n
    x = np.full(lanes, STATE_LOW, np.uint64)
    words = []
    for row in lane_steps(n, version, lanes):
        if stored:
            break
        on = row >= 0  # a short last row leaves some lanes (or all) idle at this step
        s = sym[row[on]]
        f, c = f_arr[s], cum[s]
        xs = x[on]
        need = xs >= (f << np.uint64(32 - PROB_BITS))
        if prefix + 2 * (len(words) + int(need.sum())) >= 1 + n:
            stored = True
            break
        words.extend(int(v) for v in (xs[need] & np.uint64(0xFFFF)))  # boolean indexing keeps lane order
        xs[need] >>= np.uint64(16)
        x[on] = (xs // f << np.uint64(PROB_BITS)) + xs % f + c
    if stored:
        seg = bytes([0]) + sym.tobytes()
    else:
        seg = bytes([1]) + table + bytes(wpos - 1 - len(table)) + np.uint32(len(words)).tobytes() + \
            x.astype("<u4").tobytes() + np.array(words, "<u2").tobytes()
    return seg + bytes(align(len(seg)) - len(seg))


def fixed_table(counts: np.ndarray) -> list:
    """The 7 most frequent symbols: count descending, then symbol ascending."""
    order = sorted(range(256), key=lambda v: (-int(counts[v]), v))
    return order[:7]


def encode_block_fixed(sym: np.ndarray) -> bytes:
    n = sym.size
    table = fixed_table(np.bincount(sym, minlength=256))
    code = np.full(256, 7, np.uint32)
    code[table] = np.arange(7, dtype=np.uint32)
    c = code[sym]
    esc = sym[c == 7]
    steps = -(-n // LANES)
    if 12 + 12 * steps + esc.size >= 1 + n:
        seg = bytes([0]) + sym.tobytes()
    else:
        cp = np.zeros(steps * LANES, np.uint32)
        cp[:n] = c
        lanes = cp.reshape(steps, LANES)
        weights = np.uint32(1) << np.arange(LANES, dtype=np.uint32)
        planes = np.stack([((lanes >> j) & 1) @ weights for j in range(3)], axis=1).astype("<u4")
        seg = bytes([2]) + bytes(table) + np.uint32(esc.size).tobytes() + planes.tobytes() + esc.tobytes()
    return seg + bytes(align(len(seg)) - len(seg))


def decode_block_fixed(seg: bytes, n: int) -> np.ndarray:
    steps = -(-n // LANES)
    nesc = int(np.frombuffer(seg, "<u4", 1, 8)[0])
    if 12 + 12 * steps + nesc > len(seg):
        raise ValueError("fixed segment too short")
    planes = np.frombuffer(seg, "<u4", 3 * steps, 12).reshape(steps, 3)
    bits = (planes[:, :, None] >> np.arange(LANES, dtype=np.uint32)) & 1
    c = (bits[:, 0] | bits[:, 1] << 1 | bits[:, 2] << 2).reshape(-1)[:n]
    table = np.frombuffer(seg, np.uint8, 7, 1)
    out = np.empty(n, np.uint8)
    esc = c == 7
    if int(esc.sum()) != nesc:
        raise ValueError("escape count mismatch")
    out[~esc] = table[c[~esc]]
    out[esc] = np.frombuffer(seg, np.uint8, nesc, 12 + 12 * steps)
    return out


def header(dtype: int, codec: int, shape, numel: int, total: int, block_log2: int, lanes: int = LANES) -> bytes:
    h = MAGIC + bytes([VERSION, dtype, codec, len(shape)]) + np.array([total, numel], "<u8").tobytes()
    h += bytes([block_log2, PROB_BITS, lanes, 0, 0, 0, 0, 0]) + np.array(shape, "<i8").tobytes()
    h = h[:28] + np.uint32(header_sum(h)).tobytes() + h[32:]
    return h + bytes(align(len(h)) - len(h))


def compress(data: bytes, dtype: int, shape, codec: int = 1, block_log2: int = None, lanes: int = None) -> bytes:
    """data: the tensor's bytes; dtype: format dtype code; codec: 1 rANS, 2 fixed. block_log2 and
    lanes override the encoder's plan (any block size a decoder accepts, 64 lanes with rANS), so
    tests can make small streams of every shape the format allows."""
    numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if dtype not in CODED or numel == 0:
        head = header(dtype, 0, shape, numel, 0, 0)
        body = data + bytes(align(len(head) + len(data)) - len(head) - len(data)) + raw_sums(data) if data else b""
        return header(dtype, 0, shape, numel, len(head) + len(body), 0) + body
    sym, p8, p16 = split(dtype, np.frombuffer(data, np.uint8))
    nsym = sym.size
    wide = codec == 1 and dtype != FP32  # 64 lanes: rANS only, and fp32 stays at 32
    lg = block_log2_of(nsym, wide) if block_log2 is None else block_log2
    if lanes is None:
        lanes = WIDE_LANES if wide and lg == WIDE_LOG2 else LANES
    nblocks = -(-nsym // (1 << lg))
    head_len = len(header(dtype, codec, shape, numel, 0, lg, lanes))
    raw = p8.tobytes()
    if p16 is not None:
        raw += bytes(align(head_len + len(raw)) - head_len - len(raw)) + p16.astype("<u2").tobytes()
    raw += bytes(align(head_len + len(raw)) - head_len - len(raw))
    enc = encode_block_fixed if codec == 2 else (lambda s: encode_block(s, VERSION, lanes))
    segs = [enc(sym[b << lg: (b + 1) << lg]) for b in range(nblocks)]
    offs = np.cumsum([len(s) for s in segs]).astype("<u8").tobytes()
    offs += np.array(block_sums(dtype, data, lg, VERSION), "<u4").tobytes()
    offs += bytes(align(len(offs)) - len(offs))
    coded = b"".join(segs)
    total = head_len + len(raw) + len(offs) + len(coded)
    return header(dtype, codec, shape, numel, total, lg, lanes) + raw + offs + coded


def decompress(stream: bytes) -> tuple:
    """-> (dtype code, shape, tensor bytes). Raises ValueError on any inconsistency
    it checks (not every one the C++ decoder checks: this is a reference, not a validator)."""
    if stream[:4] != MAGIC or stream[4] not in READ_VERSIONS:
        raise ValueError("not a v1 to v4 portable_zip stream")
    version = stream[4]
    summed = version >= 2  # v1 predates the checksums
    dtype, codec, ndim = stream[5], stream[6], stream[7]
    total, numel = np.frombuffer(stream[8:24], "<u8").tolist()
    lg, lanes = stream[24], stream[26]
    if lanes != LANES and not (lanes == WIDE_LANES and version >= 4 and codec == 1):
        raise ValueError("bad lane count")
    shape = tuple(np.frombuffer(stream[32: 32 + 8 * ndim], "<i8").tolist())
    raw_begin = align(32 + 8 * ndim)
    if summed and int(np.frombuffer(stream[28:32], "<u4")[0]) != header_sum(stream[: 32 + 8 * ndim]):
        raise ValueError("header checksum mismatch")
    if codec == 0:
        data = stream[raw_begin: raw_begin + numel * ELEM[dtype]]
        if summed and data:
            at = align(raw_begin + len(data))
            sums = raw_sums(data)
            if stream[at: at + len(sums)] != sums:
                raise ValueError("raw payload checksum mismatch")
        if dtype == 12 and any(b > 1 for b in data):
            raise ValueError("invalid bool byte")
        return dtype, shape, data
    nsym = nsym_of(dtype, numel)
    nblocks = -(-nsym // (1 << lg))
    p8 = np.frombuffer(stream, np.uint8, nsym, raw_begin)
    end = raw_begin + nsym
    p16 = None
    if dtype == FP32:
        p16 = np.frombuffer(stream, "<u2", nsym, align(end))
        end = align(end) + 2 * nsym
    offs_begin = align(end)
    offs = np.frombuffer(stream, "<u8", nblocks, offs_begin).tolist()
    sums = np.frombuffer(stream, "<u4", nblocks if summed else 0, offs_begin + 8 * nblocks).tolist()
    coded_begin = align(offs_begin + 8 * nblocks + 4 * len(sums))
    sym = np.empty(nsym, np.uint8)
    for b in range(nblocks):
        seg = stream[coded_begin + (offs[b - 1] if b else 0): coded_begin + offs[b]]
        n = min(nsym, (b + 1) << lg) - (b << lg)
        sym[b << lg: (b << lg) + n] = decode_block_fixed(seg, n) if seg[0] == 2 else decode_block(seg, n, version, lanes)
    data = join(dtype, numel, sym, p8, p16)
    if summed:
        for b, (got, want) in enumerate(zip(block_sums(dtype, data, lg, version), sums)):
            if got != want:
                raise ValueError(f"block {b} checksum mismatch")
    return dtype, shape, data


def decode_block(seg: bytes, n: int, version: int = VERSION, lanes: int = LANES) -> np.ndarray:
    if seg[0] == 0:
        return np.frombuffer(seg, np.uint8, n, 1)
    pos, freq = 2, [0] * 256

    def get():
        nonlocal pos
        v = seg[pos]
        pos += 1
        if v & 0x80:
            v = (v & 0x7F) << 8 | seg[pos]
            pos += 1
        return v

    if seg[1] == 0:
        lo, hi = seg[2], seg[3]
        pos = 4
        for s in range(lo, hi + 1):
            freq[s] = get()
    else:
        bm, pos = seg[2:34], 34
        for s in range(256):
            if bm[s >> 3] >> (s & 7) & 1:
                freq[s] = get()
    if sum(freq) != PROB_SCALE:
        raise ValueError("bad table")
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint64)
    lookup = np.repeat(np.arange(256, dtype=np.uint8), freq)
    wpos = align(pos, 4)
    nwords = int(np.frombuffer(seg, "<u4", 1, wpos)[0])
    x = np.frombuffer(seg, "<u4", lanes, wpos + 4).astype(np.uint64)
    words = np.frombuffer(seg, "<u2", nwords, wpos + 4 + 4 * lanes).astype(np.uint64)
    f_arr = np.array(freq, np.uint64)
    out = np.empty(n, np.uint8)
    rp = nwords
    for row in lane_steps(n, version, lanes)[::-1]:
        on = row >= 0
        xs = x[on]
        s = lookup[(xs & np.uint64(PROB_SCALE - 1)).astype(np.int64)]
        out[row[on]] = s
        xs = f_arr[s] * (xs >> np.uint64(PROB_BITS)) + (xs & np.uint64(PROB_SCALE - 1)) - cum[s]
        need = xs < STATE_LOW
        cnt = int(need.sum())
        if cnt > rp:
            raise ValueError("corrupted rANS data")
        xs[need] = xs[need] << np.uint64(16) | words[rp - cnt: rp]  # the step's words, in lane order
        rp -= cnt
        x[on] = xs
    if rp != 0 or not np.all(x == STATE_LOW):
        raise ValueError("corrupted rANS data")
    return out
