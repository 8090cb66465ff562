"""CPU codec throughput for one bf16 tensor, 1 thread and all threads: the
cost of format v2's checksums is the difference between runs of two builds.

    python -P bench/checksum_cost.py --json bench/results/cpu-checksum-cost.json [--label v2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

import portable_zip as pz

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench.common import machine_info  # noqa: E402


def timed(fn, reps: int) -> tuple:
    """Median wall seconds and median CPU seconds (this process, all threads) of fn().
    CPU time is the robust one on a shared machine: it does not count time
    spent waiting for a core."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--label", default=f"format v{pz.backend_info()['format_version']}")
    p.add_argument("--json", default=None, help="append this run's rows to this JSON file")
    args = p.parse_args()
    n = args.mib << 19  # bf16 elements
    t = (torch.from_numpy(np.random.default_rng(1).standard_normal(n, dtype=np.float32)) * 0.02).to(torch.bfloat16)
    rows = []
    for threads in (1, torch.get_num_threads()):
        buf = pz.compress(t, threads=threads)
        out = torch.empty_like(t)
        c, cc = timed(lambda: pz.compress(t, threads=threads), args.reps)
        d, dc = timed(lambda: pz.decompress(buf, out=out, threads=threads), args.reps)
        assert torch.equal(out.view(torch.int16), t.view(torch.int16))
        row = {"label": args.label, "tensor": "bf16 N(0,0.02^2)", "bytes": t.nbytes, "threads": threads,
               "ratio": buf.numel() / t.nbytes, "compress_GBps": t.nbytes / c / 1e9,
               "decompress_GBps": t.nbytes / d / 1e9, "compress_GB_per_cpu_s": t.nbytes / cc / 1e9,
               "decompress_GB_per_cpu_s": t.nbytes / dc / 1e9, "reps": args.reps,
               "load_average": os.getloadavg()[0]}
        print(json.dumps(row))
        rows.append(row)
    if args.json:
        doc = json.load(open(args.json)) if os.path.exists(args.json) else {"runs": []}
        doc["runs"].append({"machine": machine_info(), "rows": rows})
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
