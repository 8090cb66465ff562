"""The CPU codec's AVX2 paths (include/portable_zip/cpu_simd.h) and its
scalar code give the same bytes and decode each other's streams: tensors
drawn fresh here are coded in this process (AVX2 where the CPU has it) and in
a child with PZ_CPU_SIMD=0 (scalar), and the streams compared byte for byte.
CI runs the whole suite on an AVX2 host, so this is where the scalar path is
checked against it."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import portable_zip as pz
from conftest import fresh_rng, random_bits, same_bits, weights

CHILD = r"""
import sys, torch, portable_zip as pz
assert pz.backend_info()["cpu_simd"] == "scalar"
src = torch.load(sys.argv[1])
out = {"streams": [pz.compress(t, codec=c, threads=1) for t, c in src["tensors"]],
       "decoded": [pz.decompress(b, threads=1) for b in src["streams"]]}
torch.save(out, sys.argv[2])
"""


def cases(rng):
    ts = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2):
        for n in (1, 255, 256, 4097, 65_536 + 77, 300_001):
            ts.append((weights(rng, n, dtype, float(rng.choice([0.02, 1.0, 1e-3]))), "rans"))
        ts.append((random_bits(rng, 70_001, dtype), "rans"))  # blocks near and past the stored limit
        ts.append((weights(rng, 70_001, dtype), "fixed"))
    # Mostly one exponent with rare others: long runs without renormalization, then bursts.
    t = weights(rng, 200_000, torch.bfloat16, 1.0)
    t[rng.integers(0, t.numel(), 300)] = 1e-30
    ts.append((t, "rans"))
    return ts


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
    mine = [pz.compress(t, codec=c, threads=1) for t, c in ts]
    torch.save({"tensors": ts, "streams": mine}, tmp_path / "in.pt")
    env = dict(os.environ, PZ_CPU_SIMD="0")
    subprocess.run([sys.executable, "-P", "-c", CHILD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                   check=True, cwd=tmp_path)
    theirs = torch.load(tmp_path / "out.pt")
    for (t, c), a, b, back in zip(ts, mine, theirs["streams"], theirs["decoded"]):
        assert torch.equal(a, b), f"AVX2 and scalar bytes differ for {t.dtype}[{t.numel()}] {c}"
        assert same_bits(back, t)  # scalar decodes the AVX2 stream
        assert same_bits(pz.decompress(b, threads=1), t)  # and the reverse


def test_simd_decoder_rejects_what_scalar_rejects():
    """Truncated coded words: both decoders raise (the AVX2 one reads the
    last words through a bounded copy)."""
    rng = fresh_rng()
    t = weights(rng, 1 << 16, torch.bfloat16)
    buf = pz.compress(t).clone()
    info = pz.inspect(buf)
    begin = info["compressed_bytes"] - info["coded_bytes"]
    bad = buf.clone()
    bad[begin + 200: begin + 260] = torch.from_numpy(rng.integers(0, 256, 60, dtype=np.uint8))
    for simd in ("1", "0"):
        r = subprocess.run([sys.executable, "-P", "-c",
                            "import sys, torch, portable_zip as pz\n"
                            "b = torch.frombuffer(bytearray(sys.stdin.buffer.read()), dtype=torch.uint8)\n"
                            "try:\n    pz.decompress(b)\nexcept pz.FormatError as e:\n    print('raised', e)\n"],
                           input=bad.numpy().tobytes(), capture_output=True, env=dict(os.environ, PZ_CPU_SIMD=simd),
                           check=True)
        assert r.stdout.startswith(b"raised corrupted stream"), (simd, r.stdout, r.stderr)
