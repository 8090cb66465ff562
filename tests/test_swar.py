"""The GPU kernels' word-at-a-time split and join (include/portable_zip/swar.h,
behind split_chunk and join_row) against FloatTraits, on the host: CI has no
GPU, so this is where their shifts and byte permutes are checked. Builds
tests/swar/check_swar.cpp with the system C++ compiler (UBSan on) and runs it:
every 16-bit value in every symbol position for bf16, fp16 and fp8 pairs,
every half of every fp32 element, edge values, and millions of random chunks."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import fresh_rng

ROOT = Path(__file__).resolve().parents[1]
RANDOM_CHUNKS = int(os.environ.get("PZ_SWAR_CHUNKS", "3000000"))  # per dtype


def test_split_and_join_words_match_float_traits(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        pytest.fail("tests/test_swar.py needs a C++17 compiler on PATH (g++ or c++, or set CXX)")
    exe = tmp_path / "check_swar"
    subprocess.run([cxx, "-std=c++17", "-O2", "-fsanitize=undefined", "-fno-sanitize-recover=all",
                    f"-I{ROOT / 'include'}", str(ROOT / "tests/swar/check_swar.cpp"), "-o", str(exe)], check=True)
    seed = str(int(fresh_rng().integers(0, 2**62)))
    res = subprocess.run([str(exe), seed, str(RANDOM_CHUNKS)], capture_output=True, text=True, timeout=300)
    sys.stdout.write(res.stdout + res.stderr)
    assert res.returncode == 0, f"seed {seed}:\n{res.stdout}{res.stderr[-4000:]}"
    assert res.stdout.splitlines()[-1] == "0 failures"
