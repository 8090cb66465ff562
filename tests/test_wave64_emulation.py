"""AMD's wave64 paths (PZ_WARP_SIZE == 64) run on an NVIDIA GPU: a package
built with PZ_EMULATE_WAVE64=1 (a wave is two warps kept in step:
include/portable_zip/intrinsics.h) writes the CPU codec's bytes and decodes
its streams exactly, every dtype, every kernel path, sizes around every
row, block and chunk boundary, the goldens and the delta codec.

    PZ_EMULATE_WAVE64=1 PZ_BACKEND=cuda PZ_ARCHS=90 pip install --no-build-isolation --no-deps \\
        --config-settings=build-dir=/tmp/pz64-build --target /tmp/pz64 .
    PZ_WAVE64_BUILD=/tmp/pz64 pytest tests/test_wave64_emulation.py      (ci/gpu's wave64 stage)

Each check runs in a subprocess that imports the emulation build from
PZ_WAVE64_BUILD (this file as a script: `python tests/test_wave64_emulation.py
CASE`), so it never meets this process's portable_zip. Skipped without a
CUDA GPU or PZ_WAVE64_BUILD; a PZ_WAVE64_BUILD that is not an emulation
build fails."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
BUILD = os.environ.get("PZ_WAVE64_BUILD", "")
# The emulation's wave barrier (intrinsics.h, wave_emu::wave_barrier) in the built PTX; a normal build has none.
WAVE_BARRIER = re.compile(rb"barrier\.sync\s+%r\d+,\s*64;")
CODED = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]
CASE_TIMEOUT = 300  # expected under a minute a case: a hung wave barrier fails here


def emulation_ptx(build: Path) -> list:
    return sorted((build / "portable_zip" / "device").glob("compute_*.ptx"))


def run_case(case: str, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=BUILD, TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), case, *args], env=env, cwd=TESTS,
                       capture_output=True, text=True, timeout=CASE_TIMEOUT)
    assert r.returncode == 0, f"{case} {args}: rc {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    assert f"ok {case}" in r.stdout, r.stdout[-4000:]


if __name__ != "__main__":
    import torch

    pytestmark = pytest.mark.gpu
    if not BUILD:
        pytest.skip("needs PZ_WAVE64_BUILD (a --target dir of a PZ_EMULATE_WAVE64=1 build)", allow_module_level=True)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU", allow_module_level=True)

    def test_build_is_the_emulation():
        ptx = emulation_ptx(Path(BUILD))
        assert ptx, f"no PTX under {BUILD}/portable_zip/device: not a CUDA build"
        assert all(WAVE_BARRIER.search(p.read_bytes()) for p in ptx), \
            f"{ptx}: no 64-thread wave barrier: built without PZ_EMULATE_WAVE64=1"
        run_case("which")

    def test_goldens():
        run_case("goldens")

    @pytest.mark.parametrize("dtype", CODED)
    def test_sizes(dtype):
        run_case("sizes", dtype)

    @pytest.mark.parametrize("dtype", CODED)
    def test_paths(dtype):
        run_case("paths", dtype)

    def test_raw_dtypes():
        run_case("raw")

    @pytest.mark.parametrize("dtype", CODED)
    def test_delta(dtype):
        run_case("delta", dtype)


# --- the worker: runs in the subprocess, against the emulation build ----------------------------------------------

def _worker(case: str, args: list) -> None:
    import json

    import numpy as np
    import torch

    import portable_zip as pz
    from conftest import forced_plan, random_bits, same_bits, weights
    from test_errors import resign

    where = Path(pz.__file__).resolve()
    assert str(where).startswith(str(Path(BUILD).resolve())), f"imported {where}, not the build in {BUILD}"
    assert pz.backend_info()["backend"] == "cuda", pz.backend_info()
    dev = "cuda"
    rng = np.random.default_rng()

    def roundtrip(t: torch.Tensor, codec: str = "rans", offset: int = 0) -> None:
        """GPU bytes == CPU bytes; GPU decodes GPU (host- and device-parsed), CPU decodes GPU, GPU decodes CPU."""
        if offset:
            flat = torch.empty(t.numel() + offset, dtype=t.dtype, device=dev)
            g = flat[offset:].view(t.shape)
            g.copy_(t)
        else:
            g = t.to(dev)
        padded = pz.compress(g, codec=codec)
        gpu = pz.trim(padded).cpu()
        cpu = pz.compress(t, codec=codec)
        what = f"{t.dtype}{list(t.shape)} {codec} offset {offset}"
        assert torch.equal(gpu, cpu), f"GPU and CPU bytes differ: {what}"
        assert same_bits(pz.decompress(padded).cpu(), t), what
        assert same_bits(pz.decompress(gpu), t), what
        assert same_bits(pz.decompress(cpu.to(dev)).cpu(), t), what
        if t.numel():
            out = torch.empty_like(t, device=dev)
            pz.decompress(cpu.to(dev), out=out, check=True)
            assert same_bits(out.cpu(), t), f"device-parsed: {what}"

    def numels(dtype: torch.dtype) -> list:
        """Symbols around a chunk (8), a row (256), 2^12-symbol blocks, their counts past one CTA's ticket and
        the block sizes 2^13 (from 2^22 symbols) and 2^14 (from 2^25, past the 8 KB staging); fp8: two
        elements a symbol, odd counts too (the last symbol's implicit zero)."""
        per = 2 if dtype.itemsize == 1 else 1
        symbols = [1, 2, 7, 8, 9, 31, 33, 255, 256, 257, 4095, 4096, 4097, 8191, 8193, 3 * 4096 + 5,
                   (1 << 16) - 1, (1 << 16) + 1, (1 << 20) + 7, (1 << 21) + 3, (1 << 22) + 1, (1 << 25) + 1]
        out = [0]
        for s in symbols:
            out += [s * per - 1, s * per] if per == 2 else [s]
        return out

    if case == "which":
        print(where, pz.backend_info())
    elif case == "goldens":
        golden = TESTS / "golden"
        current = pz.backend_info()["format_version"]
        for d in sorted(p for p in [golden, *golden.glob("v[0-9]*")] if (p / "manifest.json").exists()):
            for name, meta in json.loads((d / "manifest.json").read_text()).items():
                dtype = getattr(torch, meta["dtype"])
                raw = (d / f"{name}.in").read_bytes()
                t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw \
                    else torch.empty(0, dtype=dtype)
                t = t.reshape(meta["shape"])
                want = (d / f"{name}.pz").read_bytes()
                buf = torch.frombuffer(bytearray(want), dtype=torch.uint8)
                assert same_bits(pz.decompress(buf.to(dev)).cpu(), t), f"{d.name}/{name}: GPU decode"
                if d.name != f"v{current}":
                    continue
                if t.numel():
                    out = torch.empty_like(t, device=dev)
                    pz.decompress(buf.to(dev), out=out, check=True)
                    assert same_bits(out.cpu(), t), f"{d.name}/{name}: device-parsed GPU decode"
                if "plan" in meta:  # the reference encoder's plan (any block size), forced on both encoders
                    with forced_plan(meta["plan"]["block_log2"], meta["plan"]["lanes"]):
                        got, want = pz.trim(pz.compress(t.to(dev))).cpu(), pz.compress(t)
                    assert torch.equal(got, want), f"{d.name}/{name}: GPU and CPU bytes differ"
                else:
                    got = pz.trim(pz.compress(t.to(dev), codec=meta["codec"])).cpu().numpy().tobytes()
                    assert got == want, f"{d.name}/{name}: GPU bytes differ from the golden"
    elif case == "sizes":
        dtype = getattr(torch, args[0])
        for n in numels(dtype):
            w = weights(rng, n, dtype)
            roundtrip(w)
            roundtrip(random_bits(rng, n, dtype))  # stored blocks
            roundtrip(w, "fixed")
    elif case == "paths":
        dtype = getattr(torch, args[0])
        esize = dtype.itemsize
        for offset in range(1, 16 // esize):  # the unaligned kernels
            for n in (1, 9, 300, 4097 + 3 * offset, 70_001):
                roundtrip(weights(rng, n, dtype), offset=offset)
                roundtrip(random_bits(rng, n, dtype), offset=offset)
                roundtrip(weights(rng, n, dtype), "fixed", offset=offset)
        with forced_plan(15, 64):  # 64 rANS lanes: two states a lane, the wide staging buffer
            for n in (1, 4097, 70_001, (1 << 17) + 77, (1 << 20) + 12_345):
                roundtrip(weights(rng, n, dtype))
                roundtrip(random_bits(rng, n, dtype))
            roundtrip(weights(rng, (1 << 17) + 77, dtype), offset=16 // esize - 1)
            t = weights(rng, (1 << 20) + 1000, dtype)
            one = pz.trim(pz.compress(t.to(dev), max_sms=1)).cpu()  # one CTA: every ticket's look-back in turn
            assert torch.equal(one, pz.compress(t))
            assert same_bits(pz.decompress(one.to(dev), max_sms=1).cpu(), t)
        ts = [weights(rng, n, dtype) for n in ((1 << 20) + 3, 70_001, 1, 4097)] + [random_bits(rng, 9000, dtype)]
        for codec in ("rans", "fixed"):  # the batched kernels, and the device-parsed batch decode
            got = pz.compress_batch([x.to(dev) for x in ts], codec=codec)
            for g, x in zip(got, ts):
                assert torch.equal(pz.trim(g).cpu(), pz.compress(x, codec=codec)), f"batch {codec} {x.numel()}"
            outs = [torch.empty_like(x, device=dev) for x in ts]
            pz.decompress_batch(got, out=outs)
            pz.check()
            assert all(same_bits(o.cpu(), x) for o, x in zip(outs, ts)), f"decompress_batch {codec}"
        t = weights(rng, (1 << 20) + 5, dtype)
        one = pz.trim(pz.compress(t.to(dev), max_sms=1)).cpu()
        assert torch.equal(one, pz.compress(t))
    elif case == "raw":
        for n in (0, 1, 3, 33, 65_535, 65_537, 200_003):  # 64 KiB checksum chunks and odd tails
            roundtrip(random_bits(rng, n, torch.uint8))
            roundtrip(torch.from_numpy(rng.integers(0, 2, n).astype(np.bool_)))
            roundtrip(random_bits(rng, n, torch.int32))
        roundtrip(random_bits(rng, 70_001, torch.int64).reshape(-1, 1))
        roundtrip(random_bits(rng, 100_003, torch.int16), offset=3)
        # A uint8 stream relabelled bool: the bool check's ballot must flag it, as the CPU does.
        buf = pz.compress(random_bits(rng, 200_003, torch.uint8)).clone()
        buf[5] = 12
        for where_ in ("cpu", dev):
            out = torch.zeros(200_003, dtype=torch.bool, device=where_)
            try:
                pz.decompress(resign(buf).to(where_), out=out, check=True)
            except pz.FormatError as e:
                assert "bool" in str(e), (where_, e)
            else:
                raise AssertionError(f"{where_}: an invalid bool decoded")
    elif case == "delta":
        from test_delta import BLOCK, stepped

        dtype = getattr(torch, args[0])
        for n in (0, 1, 7, 33, 257, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 333, 17 * BLOCK + 5):
            for frac in (0.0, 0.01, 0.3, 1.0):
                base = weights(rng, n, dtype)
                pairs = [(base, stepped(rng, base, frac))]
                if frac == 1.0:
                    pairs.append((random_bits(rng, n, dtype), random_bits(rng, n, dtype)))
                for b, target in pairs:
                    cpu = pz.delta.encode(b, target)
                    gb = b.to(dev)
                    gpu = pz.delta.encode(gb, target.to(dev))
                    assert torch.equal(gpu.cpu(), cpu), f"delta {dtype} {n} {frac}: GPU bytes differ"
                    for s in (gpu, cpu):
                        got = gb.clone()
                        pz.delta.apply(got, s)
                        assert same_bits(got.cpu(), target), f"delta {dtype} {n} {frac}: GPU apply"
            if n:  # the checksum kernel: group sums over every thread of the grid
                assert pz.delta.checksum(base.to(dev)) == pz.delta.checksum(base), f"checksum {dtype} {n}"
    else:
        raise SystemExit(f"unknown case {case}")
    torch.cuda.synchronize()
    print(f"ok {case}")


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
