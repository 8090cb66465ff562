"""The encoder's plan (block size, rANS lanes) against speed and ratio, one
build, one run: the plans named (block sizes 2^10-2^15, 32 or 64 lanes) at each size, timed as
bench/codec.py times ours (device events around one call, inputs rotated past
L2), with the plan forced through _C.test_plan_override. What it answers:
which plan choose_block_log2 and plan_header should pick at each size.

    python -P bench/plan_sweep.py [--sizes 1MiB,4MiB,16MiB,64MiB] [--plans 12/32,13/64,...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/codec.py and bench/pzbench
import codec as bench_codec  # noqa: E402
from pzbench.common import fmt_size, machine_info, parse_size, print_table  # noqa: E402

DEFAULT_PLANS = "0/32,11/32,12/32,12/64,13/32,13/64,14/32,14/64,15/64"


def same_bytes(tensor: str, nbytes: int, seed: int) -> bool:
    """GPU stream == CPU stream under the plan in force, and the GPU decodes the CPU's stream."""
    import portable_zip as pz

    t = bench_codec.gpu_tensor(tensor, nbytes, torch.Generator(device="cuda").manual_seed(seed + nbytes))
    cpu = pz.compress(t.cpu())
    return torch.equal(pz.trim(pz.compress(t)).cpu(), cpu) and torch.equal(
        pz.decompress(cpu.cuda()).view(torch.uint8), t.view(torch.uint8))


def sweep(systems, tensors, sizes, plans, reps, seed, check=True):
    from portable_zip import _C

    rows = []
    for lg, lanes in plans:
        _C.test_plan_override(lg, lanes)
        try:
            same = {n: same_bytes(tensors[0], n, seed) for n in sizes} if check else {}
            for system in systems:
                for r in bench_codec.measure(system, tensors, sizes, reps, seed):
                    r["plan"] = "default" if lg == 0 else f"2^{lg}/{lanes}"
                    if r.get("tensor") == tensors[0] and r.get("bytes") in same:
                        r["gpu_bytes_eq_cpu"] = same[r["bytes"]]
                    rows.append(r)
        finally:
            _C.test_plan_override(0, 32)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1MiB,4MiB,16MiB,64MiB")
    p.add_argument("--batch-size", default="1MiB", help="compress_batch of 64 tensors of this size ('' to skip)")
    p.add_argument("--plans", default=DEFAULT_PLANS, help="block_log2/lanes, 0/32 = the encoder's own plan")
    p.add_argument("--tensors", default=bench_codec.HEAD_TO_HEAD)
    p.add_argument("--systems", default="ours,ours-api")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("plan_sweep: needs a GPU", file=sys.stderr)
        return 2
    plans = [tuple(int(x) for x in s.split("/")) for s in a.plans.split(",")]
    tensors = a.tensors.split(";")
    rows = sweep(a.systems.split(","), tensors, [parse_size(s) for s in a.sizes.split(",")], plans, a.reps, a.seed)
    if a.batch_size:
        rows += sweep(["ours-batch"], tensors[:1], [parse_size(a.batch_size)], plans, a.reps, a.seed, check=False)
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        r.setdefault("gpu_bytes_eq_cpu", "")
    for r in rows:
        if "error" in r:
            print(f"ERROR {r['system']} {r.get('tensor')} {fmt_size(r.get('bytes', 0))} {r['plan']}: {r['error']}")
    print_table(ok, ["system", "tensor", "bytes", "plan", "ratio", "compress_us", "decompress_us", "gpu_bytes_eq_cpu"],
                "plans (µs; ratio = compressed/original)")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"machine": machine_info(), "method": __doc__, "rows": rows}, f, indent=1, default=str)
            f.write("\n")
    if any(r.get("gpu_bytes_eq_cpu") is False for r in rows):
        print("GPU and CPU bytes differ under some plan", file=sys.stderr)
        return 1
    return 0 if ok and len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
