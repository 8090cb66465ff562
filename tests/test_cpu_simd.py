"""The CPU codec's AVX2 paths (include/portable_zip/cpu_simd.h) and its
scalar code give the same bytes and decode each other's streams: tensors
drawn fresh here are coded in this process (AVX2 where the CPU has it) and in
a child with PZ_CPU_SIMD=0 (scalar), and the streams compared byte for byte.
CI runs the whole suite on an AVX2 host, so this is where the scalar path is
checked against it."""
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import portable_zip as pz
from conftest import forced_plan, fresh_rng, random_bits, same_bits, weights

CHILD = r"""
import sys, torch, portable_zip as pz
from portable_zip import _C
assert pz.backend_info()["cpu_simd"] == "scalar"
src = torch.load(sys.argv[1])
def compress(t, c, plan):
    _C.test_plan_override(*(plan or (0, 32)))
    return pz.compress(t, codec=c, threads=1)
out = {"streams": [compress(t, c, plan) for t, c, plan in src["tensors"]],
       "decoded": [pz.decompress(b, threads=1) for b in src["streams"]]}
torch.save(out, sys.argv[2])
"""


def cases(rng):
    """(tensor, codec, forced plan or None)."""
    ts = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2):
        for n in (1, 255, 256, 4097, 65_536 + 77, 300_001):
            ts.append((weights(rng, n, dtype, float(rng.choice([0.02, 1.0, 1e-3]))), "rans", None))
        ts.append((random_bits(rng, 70_001, dtype), "rans", None))  # blocks near and past the stored limit
        ts.append((weights(rng, 70_001, dtype), "fixed", None))
        # 64 lanes (the encoder's plan from 2^27 symbols on, forced here): whole
        # and partial rows and blocks, random bits (stored blocks).
        for n, plan in ((300_001, (15, 64)), (5_000, (10, 64))):
            ts.append((weights(rng, n, dtype, float(rng.choice([0.02, 1.0]))), "rans", plan))
        ts.append((random_bits(rng, 70_001, dtype), "rans", (12, 64)))
    # Mostly one exponent with rare others: long runs without renormalization, then bursts.
    t = weights(rng, 200_000, torch.bfloat16, 1.0)
    t[rng.integers(0, t.numel(), 300)] = 1e-30
    ts.append((t, "rans", None))
    return ts


def compress(t, codec, plan):
    with forced_plan(*plan) if plan else contextlib.nullcontext():
        return pz.compress(t, codec=codec, threads=1)


def host_has_avx2() -> bool:
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


def test_simd_and_scalar_give_the_same_bytes(tmp_path: Path):
    if host_has_avx2() and "PZ_CPU_SIMD" not in os.environ:
        assert pz.backend_info()["cpu_simd"] == "avx2"  # this process runs the AVX2 paths
    rng = fresh_rng()
    ts = cases(rng)
    mine = [compress(t, c, plan) for t, c, plan in ts]
    torch.save({"tensors": ts, "streams": mine}, tmp_path / "in.pt")
    env = dict(os.environ, PZ_CPU_SIMD="0")
    subprocess.run([sys.executable, "-P", "-c", CHILD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                   check=True, cwd=tmp_path)
    theirs = torch.load(tmp_path / "out.pt")
    for (t, c, _), a, b, back in zip(ts, mine, theirs["streams"], theirs["decoded"]):
        assert torch.equal(a, b), f"AVX2 and scalar bytes differ for {t.dtype}[{t.numel()}] {c}"
        assert same_bits(back, t)  # scalar decodes the AVX2 stream
        assert same_bits(pz.decompress(b, threads=1), t)  # and the reverse


@pytest.mark.parametrize("lanes", [32, 64])
def test_simd_decoder_rejects_what_scalar_rejects(lanes):
    """Truncated coded words: both decoders raise (the AVX2 one reads the
    last words through a bounded copy), with 32 lanes and with 64."""
    rng = fresh_rng()
    t = weights(rng, 1 << 16, torch.bfloat16)
    with forced_plan(14, lanes):
        buf = pz.compress(t).clone()
    info = pz.inspect(buf)
    begin = info["compressed_bytes"] - info["coded_bytes"]
    bad = buf.clone()
    at = begin + 200 + 4 * (lanes - 32)  # past the first segment's states (4 bytes a lane): in its words
    bad[at: at + 60] = torch.from_numpy(rng.integers(0, 256, 60, dtype=np.uint8))
    for simd in ("1", "0"):
        r = subprocess.run([sys.executable, "-P", "-c",
                            "import sys, torch, portable_zip as pz\n"
                            "b = torch.frombuffer(bytearray(sys.stdin.buffer.read()), dtype=torch.uint8)\n"
                            "try:\n    pz.decompress(b)\nexcept pz.FormatError as e:\n    print('raised', e)\n"],
                           input=bad.numpy().tobytes(), capture_output=True, env=dict(os.environ, PZ_CPU_SIMD=simd),
                           check=True)
        assert r.stdout.startswith(b"raised corrupted stream"), (simd, r.stdout, r.stderr)


# Decodes each stream at 1, 2 and 3 threads: "ok" or the error's message.
# Run here and, with PZ_CPU_SIMD=0, in a child.
OUTCOMES = r"""
def outcomes(streams):
    out = []
    for b in streams:
        row = []
        for threads in (1, 2, 3):
            try:
                pz.decompress(b, threads=threads)
                row.append("ok")
            except pz.FormatError as e:
                row.append(str(e))
        out.append(row)
    return out
"""
exec(OUTCOMES)
ERRORS_CHILD = ("import sys, torch, portable_zip as pz\n" + OUTCOMES +
                "torch.save(outcomes(torch.load(sys.argv[1])), sys.argv[2])\n")


def test_simd_and_scalar_report_the_same_errors(tmp_path: Path):
    """Corruptions in one block of a multi-block stream (the first or second
    block of a pair the AVX2 decoder runs interleaved, the last block; words,
    lane states, word counts, checksums): AVX2 and scalar decoders, at 1, 2
    and 3 threads, agree on each outcome and message."""
    rng = fresh_rng()
    t = weights(rng, 37 * 4096 + 4096 // 2 * 2, torch.bfloat16)  # 38 blocks of 4096 symbols, whole rows
    buf = pz.compress(t, threads=1)
    info = pz.inspect(buf)
    nblocks = info["blocks"]
    coded_begin = info["compressed_bytes"] - info["coded_bytes"]
    offsets_begin = -(-(48 + t.numel()) // 16) * 16  # 1-D header: raw plane at 48, then the offsets
    sums_begin = offsets_begin + 8 * nblocks
    raw = buf.numpy()
    ends = np.frombuffer(raw[offsets_begin: offsets_begin + 8 * nblocks].tobytes(), dtype="<u8").astype(np.int64)
    assert ends[-1] == info["coded_bytes"]
    begins = np.concatenate([[0], ends[:-1]])

    def seg(b):
        return coded_begin + int(begins[b]), coded_begin + int(ends[b])

    streams = [buf]
    for b in (0, 1, 2, 5, nblocks - 1):
        lo, hi = seg(b)
        assert raw[lo] == 1  # rANS mode
        words = buf.clone()  # bytes in the middle of the block's words
        mid = (lo + hi) // 2
        words[mid: mid + 8] = torch.from_numpy(rng.integers(0, 256, 8, dtype=np.uint8))
        streams.append(words)
        late = buf.clone()  # the last words (read first)
        late[hi - 24: hi - 16] ^= 0x5A
        streams.append(late)
        summed = buf.clone()
        summed[sums_begin + 4 * b] ^= 1
        streams.append(summed)
    # Word count and a lane state: their offsets depend on the table's size, so
    # find them: the word count is the u32 before the 32 states, and the states
    # are the 128 bytes before the words; the words run to the segment's end (padded).
    for b in (1, 4):
        lo, hi = seg(b)
        table_end = lo + 1
        form = raw[table_end]
        assert form in (0, 1)
        # Corrupt a lane state to below L: scan for the first offset whose 32 u32 all lie in [2^16, 2^32).
        for wpos in range(lo + 4, hi - 132, 4):
            states = np.frombuffer(raw[wpos + 4: wpos + 132].tobytes(), dtype="<u4")
            count = int(np.frombuffer(raw[wpos: wpos + 4].tobytes(), dtype="<u4")[0])
            if (states >= 1 << 16).all() and wpos + 132 + 2 * count <= hi < wpos + 132 + 2 * count + 16:
                break
        else:
            raise AssertionError("no word count and states found")
        low = buf.clone()
        low[wpos + 4 + 4 * 7 + 2: wpos + 4 + 4 * 7 + 4] = 0  # state 7 below 2^16
        streams.append(low)
        fewer = buf.clone()
        fewer[wpos] = (int(raw[wpos]) + 255) % 256  # word count off by one
        streams.append(fewer)
    torch.save(streams, tmp_path / "in.pt")
    mine = outcomes(streams)  # noqa: F821 (defined by exec(OUTCOMES))
    assert mine[0] == ["ok"] * 3 and all(r != ["ok"] * 3 for r in mine[1:]), mine
    env = dict(os.environ, PZ_CPU_SIMD="0")
    subprocess.run([sys.executable, "-P", "-c", ERRORS_CHILD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env=env, check=True, cwd=tmp_path)
    theirs = torch.load(tmp_path / "out.pt")
    for i, (a, b) in enumerate(zip(mine, theirs)):
        assert a == b, (i, a, b)
        assert len(set(a)) == 1, (i, a)  # thread counts agree too
