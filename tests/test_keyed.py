"""transport/keyed.h, the fabric's tag permutation and the liveness watch's
MAC, against SipHash-2-4 written here from the paper (Aumasson and Bernstein
2012) and the paper's own test vector. Builds tests/keyed/check_keyed.cpp with
the system C++ compiler (UBSan on): every message length 0..63 under the
paper's key and a fresh random key, and the Feistel permutation against this
file's and its own inverse."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import fresh_rng

ROOT = Path(__file__).resolve().parents[1]
M64 = (1 << 64) - 1


def _rotl(x, b):
    return ((x << b) | (x >> (64 - b))) & M64


def siphash24(key: bytes, msg: bytes) -> int:
    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def sipround():
        v[0] = (v[0] + v[1]) & M64; v[1] = _rotl(v[1], 13) ^ v[0]; v[0] = _rotl(v[0], 32)
        v[2] = (v[2] + v[3]) & M64; v[3] = _rotl(v[3], 16) ^ v[2]
        v[0] = (v[0] + v[3]) & M64; v[3] = _rotl(v[3], 21) ^ v[0]
        v[2] = (v[2] + v[1]) & M64; v[1] = _rotl(v[1], 17) ^ v[2]; v[2] = _rotl(v[2], 32)

    padded = msg + bytes(7 - len(msg) % 8) + bytes([len(msg) & 0xFF])
    for i in range(0, len(padded), 8):
        m = int.from_bytes(padded[i:i + 8], "little")
        v[3] ^= m
        sipround(); sipround()
        v[0] ^= m
    v[2] ^= 0xFF
    for _ in range(4):
        sipround()
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def permute64(key: bytes, tweak: int, x: int) -> int:
    left, right = x >> 32, x & 0xFFFFFFFF
    for r in range(4):
        f = siphash24(key, tweak.to_bytes(4, "little") + bytes([r]) + right.to_bytes(4, "little")) & 0xFFFFFFFF
        left, right = right, left ^ f
    return (left << 32) | right


def test_python_reference_matches_the_paper():
    key = bytes(range(16))
    assert siphash24(key, bytes(range(15))) == 0xA129CA6149BE45E5  # the paper's appendix A
    assert siphash24(key, b"") == 0x726FDB47DD0E0E31  # the reference code's vectors.h, first entry


@pytest.mark.parametrize("which", ["paper", "random"])
def test_header_matches_reference(tmp_path, which):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        pytest.fail("tests/test_keyed.py needs a C++17 compiler on PATH (g++ or c++, or set CXX)")
    exe = tmp_path / "check_keyed"
    subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-fsanitize=undefined",
                    "-fno-sanitize-recover=all", f"-I{ROOT / 'transport'}",
                    str(ROOT / "tests/keyed/check_keyed.cpp"), "-o", str(exe)], check=True)
    rng = fresh_rng()
    key = bytes(range(16)) if which == "paper" else rng.bytes(16)
    tweak = int(rng.integers(0, 2**32))
    res = subprocess.run([str(exe), key.hex(), str(tweak)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"key {key.hex()} tweak {tweak}:\n{res.stdout}{res.stderr}"
    lines = res.stdout.splitlines()
    assert lines[-1] == "0 failures"
    sips = [line.split() for line in lines if line.startswith("sip ")]
    perms = [line.split() for line in lines if line.startswith("perm ")]
    assert len(sips) == 64 and len(perms) == 8
    for _, n, got in sips:
        assert int(got, 16) == siphash24(key, bytes(range(int(n)))), f"length {n}, key {key.hex()}"
    for _, x, got in perms:
        assert int(got, 16) == permute64(key, tweak, int(x)), f"x {x}, key {key.hex()}, tweak {tweak}"
