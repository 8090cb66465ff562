"""Where pz.delta's GPU time goes: one tensor's encode and apply under
torch.profiler, GPU time per kernel (and host wall time per call), so a
change to the delta kernels can be judged kernel by kernel.

    python -P bench/delta_profile.py [--mib 64] [--changed 0.089] [--reps 5] [--json out.json]
"""
import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench.common import report  # noqa: E402

import portable_zip as pz  # noqa: E402


def kernels(prof) -> dict:
    """{kernel name: [launches, total GPU µs]} over the profile."""
    out = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = out.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {n: {"launches": c, "us_total": round(t, 1)} for n, (c, t) in sorted(out.items(), key=lambda x: -x[1][1])}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--changed", type=float, default=0.089)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    n = (a.mib << 20) // 2
    g = torch.Generator(device="cuda").manual_seed(0)
    base = (torch.randn(n, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    target = base.clone()
    hit = torch.rand(n, device="cuda", generator=g) < a.changed
    target.view(torch.int16)[hit] ^= 1
    s = pz.delta.encode(base, target)  # warm: modules loaded, allocator primed
    work = base.clone()
    pz.delta.apply(work, s)
    res = {"bytes": 2 * n, "changed": a.changed, "stream_bytes": s.numel()}
    for what, fn in (("encode", lambda: pz.delta.encode(base, target)),
                     ("apply", lambda: pz.delta.apply(work.copy_(base), s))):
        wall = []
        for _ in range(a.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.reps):
                fn()
            torch.cuda.synchronize()
        res[what] = {"wall_ms_best": round(1e3 * min(wall), 3), "GBps_best": 2 * n / min(wall) / 1e9,
                     "kernels_per_call": {k: {"launches": v["launches"] / a.reps, "us": round(v["us_total"] / a.reps, 1)}
                                          for k, v in kernels(prof).items()}}
    if not torch.equal(work.view(torch.int16), target.view(torch.int16)):
        raise AssertionError("apply did not rebuild the target")
    report(res, a.json)


if __name__ == "__main__":
    main()
