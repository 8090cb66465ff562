"""CPU codecs side by side on the same tensors: ours (AVX2 and scalar, 1 and
2 threads) beside zstd level 1 and ZipNN, one thread each unless said. Each
system's round trip is checked; one that fails says so in its row instead of
reporting a speed. The references are installed from PyPI on first use."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from typing import Callable, List

import numpy as np
import torch

REFS = {"zstandard": "zstandard", "zipnn": "zipnn"}


def _need(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", REFS[module]], check=True)
        return importlib.import_module(module)


def _median(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _ours(t: torch.Tensor, threads: int, reps: int) -> dict:
    import portable_zip as pz

    buf = pz.compress(t, threads=threads)
    out = torch.empty_like(t)
    ok = torch.equal(pz.decompress(buf, out=out, threads=threads).view(torch.uint8), t.view(torch.uint8))
    return {"ratio": buf.numel() / t.nbytes, "ok": ok,
            "tc": _median(lambda: pz.compress(t, threads=threads), reps),
            "td": _median(lambda: pz.decompress(buf, out=out, threads=threads), reps)}


def _zstd(t: torch.Tensor, reps: int) -> dict:
    zstd = _need("zstandard")
    raw = t.view(torch.uint8).numpy().tobytes()
    c, d = zstd.ZstdCompressor(level=1), zstd.ZstdDecompressor()
    blob = c.compress(raw)
    return {"ratio": len(blob) / len(raw), "ok": d.decompress(blob) == raw,
            "tc": _median(lambda: c.compress(raw), reps), "td": _median(lambda: d.decompress(blob), reps),
            "version": zstd.__version__}


def _zipnn(t: torch.Tensor, reps: int) -> dict:
    zipnn = _need("zipnn")
    z = zipnn.ZipNN(input_format="torch", bytearray_dtype="bfloat16", threads=1)
    blob = z.compress(t)
    back = z.decompress(blob)
    ok = isinstance(back, torch.Tensor) and back.dtype == t.dtype and torch.equal(
        back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    return {"ratio": len(blob) / t.nbytes, "ok": ok, "tc": _median(lambda: z.compress(t), reps),
            "td": _median(lambda: z.decompress(blob), reps)}


def rows(tensors: List[tuple], reps: int) -> list:
    """One row per (tensor, system). tensors: (name, bf16 CPU tensor)."""
    out = []
    simd = os.environ.get("PZ_CPU_SIMD")
    for name, t in tensors:
        systems = [("portable_zip (AVX2 if present), 1 thread", lambda: _ours(t, 1, reps)),
                   ("portable_zip (AVX2 if present), 2 threads", lambda: _ours(t, 2, reps)),
                   ("zstd -1 (python-zstandard), 1 thread", lambda: _zstd(t, reps)),
                   ("ZipNN (bf16, torch input), 1 thread", lambda: _zipnn(t, reps))]
        for label, run in systems:
            row = {"tensor": name, "bytes": t.nbytes, "system": label, "PZ_CPU_SIMD": simd}
            try:
                r = run()
                row.update(ratio=round(r["ratio"], 4), round_trip="ok" if r["ok"] else "FAILED")
                if r["ok"]:
                    row.update(compress_GBps=t.nbytes / r["tc"] / 1e9, decompress_GBps=t.nbytes / r["td"] / 1e9)
                else:  # a wrong result's speed means nothing
                    row.update(compress_GBps=float("nan"), decompress_GBps=float("nan"))
            except Exception as e:  # a reference that cannot run is reported, not fatal
                row.update(error=f"{type(e).__name__}: {e}"[:200])
            row.setdefault("error", "")
            out.append(row)
    return out
