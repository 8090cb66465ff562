"""Mutated streams: FormatError or a decode, never a crash, hang or OOB access."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import portable_zip as pz
from conftest import CODED_DTYPES, fresh_rng, weights

ROOT = Path(__file__).resolve().parents[1]
MUTATIONS = int(os.environ.get("PZ_FUZZ_MUTATIONS", "12000"))


def mutate(rng: np.random.Generator, s: np.ndarray) -> np.ndarray:
    s = s.copy()
    kind = rng.integers(0, 6)
    if kind == 0:
        return s[: rng.integers(0, s.size)]
    if kind == 1:
        for _ in range(rng.integers(1, 9)):
            i = rng.integers(0, s.size)
            s[i] ^= np.uint8(1 << rng.integers(0, 8))
    elif kind == 2:
        s[rng.integers(0, min(s.size, 48))] = rng.integers(0, 256)
    elif kind == 3:
        i = rng.integers(0, s.size)
        s[i: i + rng.integers(1, 64)] = rng.integers(0, 256)
    elif kind == 4:  # an 8-byte field (total, numel, shape, a block offset) set to a random value
        i = rng.integers(0, s.size // 8) * 8
        s[i: i + 8] = np.frombuffer(rng.integers(0, 2**63, dtype=np.int64).tobytes(), np.uint8)[: s[i: i + 8].size]
    else:
        s[-rng.integers(1, min(s.size, 300) + 1)] ^= 0xFF
    return s


def fuzz(streams, rng, count, device="cpu"):
    outcomes = {"error": 0, "decoded": 0}
    for k in range(count):
        src = streams[k % len(streams)]
        bad = torch.from_numpy(mutate(rng, src)).to(device)
        try:
            out = pz.decompress(bad)
            assert out.device.type == device
            outcomes["decoded"] += 1
        except pz.FormatError:
            outcomes["error"] += 1
    return outcomes


def make_streams(rng, device="cpu"):
    streams = []
    for dtype in CODED_DTYPES + [torch.int16]:
        for numel in (1, 50, 5000, 40_000):
            t = weights(rng, numel, dtype, 0.02) if dtype in CODED_DTYPES else torch.arange(numel, dtype=dtype)
            for codec in ("rans", "fixed"):
                streams.append(pz.trim(pz.compress(t.to(device), codec=codec)).cpu().numpy())
    return streams


def test_mutated_streams_cpu():
    rng = fresh_rng()
    outcomes = fuzz(make_streams(rng), rng, MUTATIONS)
    assert sum(outcomes.values()) == MUTATIONS
    # Both outcomes must occur, or the mutator is not exercising the decoder.
    assert outcomes["error"] > MUTATIONS // 4 and outcomes["decoded"] > 0, outcomes


def test_cpp_fuzz_under_asan(tmp_path):
    exe = tmp_path / "fuzz_decode"
    subprocess.run(["g++", "-std=c++17", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    f"-I{ROOT / 'include'}", f"-I{ROOT / 'kernels'}", str(ROOT / "tests/fuzz/fuzz_decode.cpp"),
                    str(ROOT / "kernels/cpu_launch.cpp"), "-o", str(exe), "-pthread"], check=True)
    seed = str(int(fresh_rng().integers(0, 2**62)))
    res = subprocess.run([str(exe), seed, "10000"], capture_output=True, text=True, timeout=600)
    sys.stdout.write(res.stdout + res.stderr)
    assert res.returncode == 0, f"sanitizer failure with seed {seed}:\n{res.stderr[-4000:]}"
    assert "10000 streams" in res.stdout
