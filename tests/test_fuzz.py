"""Mutated streams: FormatError or a bit-identical decode (format v2's
checksums), never wrong data, a crash, a hang or an OOB access."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import portable_zip as pz
from conftest import CODED_DTYPES, fresh_rng, same_bits, weights
from portable_zip.codec import reference as ref
from portable_zip.codec.dtypes import code_of

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


def mutate_bytes(rng: np.random.Generator, s: np.ndarray) -> np.ndarray:
    """1 to 4 bytes changed: a bit flipped or a byte replaced, anywhere."""
    s = s.copy()
    for _ in range(rng.integers(1, 5)):
        i = rng.integers(0, s.size)
        s[i] = rng.integers(0, 256) if rng.integers(0, 2) else s[i] ^ np.uint8(1 << rng.integers(0, 8))
    return s


def fuzz(streams, rng, count, device="cpu", mutator=mutate, into_out=False):
    """Decodes `count` mutants of (tensor, stream) pairs: each must raise
    FormatError or decode to exactly the original tensor. into_out: decode
    into a preallocated tensor of the original's dtype and shape (on a GPU,
    the kernels that parse the header themselves), checked at once."""
    outcomes = {"header error": 0, "decode error": 0, "identical": 0}
    for k in range(count):
        t, src = streams[k % len(streams)]
        bad = torch.from_numpy(mutator(rng, src)).to(device)
        try:
            if into_out:
                out = torch.empty_like(t, device=device)
                out.view(torch.uint8).fill_(0x5A)  # poison: every byte must be written
                pz.decompress(bad, out=out, check=True)
            else:
                out = pz.decompress(bad)
        except pz.FormatError as e:
            outcomes["decode error" if str(e).startswith("corrupted stream") else "header error"] += 1
            continue
        assert out.device.type == device
        if not same_bits(out.cpu(), t):
            m = bad.cpu().numpy()
            n = min(m.size, src.size)
            where = np.nonzero(m[:n] != src[:n])[0]
            raise AssertionError(f"a mutated {t.dtype}{list(t.shape)} stream ({src.size} bytes, mutant {m.size}) "
                                 f"decoded to {out.dtype}{list(out.shape)}, different data; changed bytes at "
                                 f"{where[:16].tolist()}: {src[where[:16]].tolist()} -> {m[where[:16]].tolist()}; "
                                 f"stream: {pz.inspect(torch.from_numpy(src))}")
        outcomes["identical"] += 1
    return outcomes


def make_streams(rng, device="cpu"):
    """(tensor on the CPU, its trimmed stream as numpy) for every coded dtype and codec, and raw dtypes."""
    streams = []
    for dtype in CODED_DTYPES + [torch.int16, torch.uint8, torch.bool]:
        for numel in (1, 50, 5000, 40_000, 70_001):
            if dtype in CODED_DTYPES:
                t = weights(rng, numel, dtype, 0.02)
            elif dtype == torch.bool:
                t = torch.from_numpy(rng.integers(0, 2, numel).astype(np.bool_))
            else:
                t = torch.from_numpy(rng.integers(0, 256, numel * dtype.itemsize, dtype=np.uint8)).view(dtype)
            for codec in ("rans", "fixed") if dtype in CODED_DTYPES else ("rans",):
                streams.append((t, pz.trim(pz.compress(t.to(device), codec=codec)).cpu().numpy()))
    # 64-lane rANS (v4), which the encoder picks for 2^27 symbols and more, on
    # small tensors: the reference encoder with 2^10-symbol blocks.
    for dtype in CODED_DTYPES:
        t = weights(rng, 5000, dtype, 0.02)
        data = t.view(torch.uint8).numpy().tobytes()
        streams.append((t, np.frombuffer(ref.compress(data, code_of(dtype), [5000], 1, 10, 64), np.uint8).copy()))
    return streams


def test_mutated_streams_cpu():
    rng = fresh_rng()
    outcomes = fuzz(make_streams(rng), rng, MUTATIONS)
    assert sum(outcomes.values()) == MUTATIONS
    # Mutants must reach the block decoder, or the mutator is not exercising it.
    assert outcomes["decode error"] > MUTATIONS // 10 and outcomes["header error"] > 0, outcomes


def test_small_mutations_never_decode_wrong():
    """Defect 9 of issue 9: 1,391 of 3,000 random 1-4-byte mutations used to
    decode without error, to different data. Now each must raise or decode
    bit-identical (a mutated padding byte)."""
    rng = fresh_rng()
    count = int(os.environ.get("PZ_SMALL_MUTATIONS", "6000"))
    outcomes = fuzz(make_streams(rng), rng, count, mutator=mutate_bytes)
    assert outcomes["decode error"] > count // 4, outcomes


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
