"""An independent pure-Python/numpy writer of weight-delta streams (version 1),
from docs/FORMAT.md ("Weight-delta streams") alone: the tests check that the
C++ encoder writes exactly its bytes and that both checksums agree."""
from __future__ import annotations

import numpy as np

MAGIC = b"PZDL"
HEADER = 64
BLOCK_LOG2 = 14
ESCAPE = 31
M32 = 0xFFFFFFFF


def fmix_terms(units: np.ndarray, index: np.ndarray) -> np.ndarray:
    """format.h hash_term, vectorized (uint32 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        t = units ^ (index * np.uint32(0x9E3779B9))
        t ^= t >> np.uint32(16)
        t *= np.uint32(0x85EBCA6B)
        t ^= t >> np.uint32(13)
        t *= np.uint32(0xC2B2AE35)
        t ^= t >> np.uint32(16)
    return t


def _term(unit: int, index: int) -> int:
    return int(fmix_terms(np.array([unit], np.uint32), np.array([index], np.uint32))[0])


def checksum(data: bytes) -> int:
    n = len(data)
    units = np.frombuffer(data + b"\0" * (-n % 4), dtype="<u4").astype(np.uint32)
    i = np.arange(units.size, dtype=np.uint64)
    ix = ((i & np.uint64(M32)) ^ (((i >> np.uint64(32)) * np.uint64(0x27D4EB2F)) & np.uint64(M32))).astype(np.uint32)
    lo = int(fmix_terms(units, ix).sum(dtype=np.uint64)) & M32
    rot = (units << np.uint32(16)) | (units >> np.uint32(16))
    hi = int(fmix_terms(rot ^ np.uint32(0x2545F491), ix ^ np.uint32(0x68E31DA4)).sum(dtype=np.uint64)) & M32
    lo = (lo + 0x4C445A50 + _term(n & M32, M32)) & M32
    hi = (hi + 0x31544C44 + _term(n >> 32, 0xFFFFFFFE)) & M32
    return hi << 32 | lo


def order(u: int, w: int) -> int:
    s, m = 1 << (w - 1), (1 << w) - 1
    return (~u & m) if u & s else (u | s)


def zigzag(b: int, t: int, w: int) -> int:
    m = (1 << w) - 1
    d = (order(t, w) - order(b, w)) & m
    x = d - (1 << w) if d >> (w - 1) else d
    return 2 * x if x >= 0 else -2 * x - 1


def choose_k(total: int, count: int, raw: int) -> int:
    if not count:
        return 0
    return min(max((total // count).bit_length() - 1, 0), raw, 31)


class Bits:
    def __init__(self):
        self.v, self.n = 0, 0

    def put(self, x: int, n: int):
        self.v |= x << self.n
        self.n += n

    def rice(self, x: int, k: int, raw: int):
        q = x >> k
        if q < ESCAPE:
            self.put((1 << q) - 1, q + 1)
            self.put(x & ((1 << k) - 1), k)
        else:
            self.put((1 << ESCAPE) - 1, ESCAPE)
            self.put(x, raw)

    def bytes(self) -> bytes:
        return self.v.to_bytes(4 * ((self.n + 31) // 32), "little")


def encode(base: bytes, target: bytes, width: int, dtype_code: int) -> bytes:
    """The stream for base -> target, element width in bits (8, 16, 32)."""
    fmt = {8: "<u1", 16: "<u2", 32: "<u4"}[width]
    b = np.frombuffer(base, fmt).astype(np.int64).tolist()
    t = np.frombuffer(target, fmt).astype(np.int64).tolist()
    n = len(b)
    bs = 1 << BLOCK_LOG2
    table, payload, changed = b"", b"", 0
    for start in range(0, n, bs):
        pos = [i for i in range(start, min(n, start + bs)) if b[i] != t[i]]
        zs = [zigzag(b[i], t[i], width) for i in pos]
        gaps, prev = [], start - 1
        for p in pos:
            gaps.append(p - prev - 1)
            prev = p
        kg = choose_k(sum(gaps), len(pos), BLOCK_LOG2)
        kv = choose_k(sum(z - 1 for z in zs), len(pos), width)
        bits = Bits()
        for g, z in zip(gaps, zs):
            bits.rice(g, kg, BLOCK_LOG2)
            bits.rice(z - 1, kv, width)
        blk = bits.bytes() if pos else b""
        if not pos:
            kg = kv = 0
        table += len(blk).to_bytes(4, "little") + len(pos).to_bytes(2, "little") + bytes([kg, kv])
        payload += blk
        changed += len(pos)
    body = table + payload
    total = HEADER + len(body)
    head = bytearray(HEADER)
    head[0:4] = MAGIC
    head[4], head[5], head[6] = 1, dtype_code, BLOCK_LOG2
    for off, v in ((8, total), (16, n), (24, changed), (32, checksum(base)), (40, checksum(target)),
                   (48, len(payload))):
        head[off:off + 8] = v.to_bytes(8, "little")
    head[56:60] = (checksum(body) & M32).to_bytes(4, "little")
    words = np.frombuffer(bytes(head[:60]), "<u4").astype(np.uint32)
    hs = (int(fmix_terms(words, np.arange(15, dtype=np.uint32)).sum(dtype=np.uint64)) + 0x505A4932) & M32
    head[60:64] = hs.to_bytes(4, "little")
    return bytes(head) + body


def resign(stream: bytearray) -> bytearray:
    """Recomputes a (tampered) stream's body and header checksums, as a
    hostile sender would: only the base and target checks remain."""
    stream[56:60] = (checksum(bytes(stream[HEADER:])) & M32).to_bytes(4, "little")
    words = np.frombuffer(bytes(stream[:60]), "<u4").astype(np.uint32)
    hs = (int(fmix_terms(words, np.arange(15, dtype=np.uint32)).sum(dtype=np.uint64)) + 0x505A4932) & M32
    stream[60:64] = hs.to_bytes(4, "little")
    return stream
