"""Host cost of the codec's public calls: microseconds until a call returns
(perf_counter, median of --reps, timed before any sync). On the GPU that is
what the CPU pays per call while kernels run (decompress_batch without out=
reads headers, so it syncs inside the call); the GPU is synchronized between
reps, outside the timed region. On the CPU the times include the coding
itself: the small sizes are where host overhead shows there. Each row also
has cpu_us, the process's CPU time over the call (median): steadier than the
wall time on a shared machine.

    python -P bench/host_cost.py [--device cuda|cpu] [--sizes 1M,4K] [--count 64] [--reps 20]
                                 [--profile] [--out FILE] [--label TEXT]

--out appends this run (machine, load average, rows, and with --profile the
profiles) to the file's "runs", so a before/after pair lives in one file.
--profile runs cProfile over each batch workload and prints its top entries
by own time; calls into _C (nanobind functions, not builtins to cProfile)
count in their Python caller's own time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

import portable_zip as pz

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench.common import fmt_size, machine_info, parse_size, print_table  # noqa: E402


def _settle(device: str) -> None:
    """Between reps, untimed: the GPU idle and the deferred decode checks read."""
    if device == "cuda":
        torch.cuda.synchronize()
    pz.check()


def host_us(fn, device: str, reps: int, warmup: int = 3) -> tuple:
    """Median microseconds until fn() returns (no sync inside the timed
    region), and median CPU microseconds of this process meanwhile (all its
    threads: on a shared machine, what the call cost without the waits for a
    core)."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(reps):
        _settle(device)
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    _settle(device)
    return 1e6 * statistics.median(wall), 1e6 * statistics.median(cpu)


def workloads(device: str, nbytes: int, count: int) -> dict:
    """name -> (tensors the call handles, fn): one call, count single calls, and the batch calls."""
    n = max(nbytes // 2, 1)
    shape = (n // 256, 256) if n % 256 == 0 else (n,)
    g = torch.Generator().manual_seed(1)
    ts = [(torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16).to(device) for _ in range(count)]
    bufs = [pz.compress(t) for t in ts]
    outs = [torch.empty_like(t) for t in ts]

    def singles_out():
        for b, o in zip(bufs, outs):
            pz.decompress(b, out=o)

    def singles_compress():
        for t in ts:
            pz.compress(t)

    return {
        "decompress(out=)": (1, lambda: pz.decompress(bufs[0], out=outs[0])),
        f"decompress(out=) x{count}": (count, singles_out),
        f"decompress_batch(out=) x{count}": (count, lambda: pz.decompress_batch(bufs, out=outs)),
        f"decompress_batch() x{count}": (count, lambda: pz.decompress_batch(bufs)),
        "compress()": (1, lambda: pz.compress(ts[0])),
        f"compress() x{count}": (count, singles_compress),
        f"compress_batch() x{count}": (count, lambda: pz.compress_batch(ts)),
    }


def profile(name: str, fn, device: str, reps: int, top: int) -> str:
    """cProfile of reps calls of fn (settled between calls, as when timed): the top entries by own time."""
    prof = cProfile.Profile()
    for _ in range(reps):
        _settle(device)
        prof.enable()
        fn()
        prof.disable()
    _settle(device)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return f"--- {name}: {reps} calls ---\n" + s.getvalue()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="1M,4K", help="bytes per tensor, comma-separated (K, M, G suffixes)")
    p.add_argument("--count", type=int, default=64, help="tensors per batch")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="cProfile the batch workloads, print the top entries")
    p.add_argument("--top", type=int, default=25, help="entries per profile")
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None, help="append this run to this JSON file")
    a = p.parse_args()
    rows, profiles = [], []
    for nbytes in [parse_size(s) for s in a.sizes.split(",") if s]:
        for op, (calls, fn) in workloads(a.device, nbytes, a.count).items():
            us, cpu_us = host_us(fn, a.device, a.reps)
            rows.append({"device": a.device, "bytes": nbytes, "size": fmt_size(nbytes), "op": op, "calls": calls,
                         "host_us": us, "us_per_tensor": us / calls, "cpu_us": cpu_us})
            if a.profile and calls > 1:
                profiles.append(profile(f"{op}, {fmt_size(nbytes)} each", fn, a.device, a.reps, a.top))
                print(profiles[-1])
    print_table(rows, ["size", "op", "host_us", "us_per_tensor", "cpu_us"],
                f"host µs until return, {a.device}, median of {a.reps} ({a.label or 'this build'})")
    if a.out:
        run = {"label": a.label, "machine": machine_info(), "reps": a.reps, "load_average": os.getloadavg(), "rows": rows}
        if profiles:
            run["profiles"] = profiles
        doc = json.load(open(a.out)) if os.path.exists(a.out) else {"runs": []}
        doc["runs"].append(run)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")


if __name__ == "__main__":
    main()
