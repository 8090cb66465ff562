"""What correctness costs per op: the spec swap that guards compressed and raw
plans (and every op under PZ_CHECK_PLANS=1), measured as µs per op on small
tensors where it dominates. Two ranks: NCCL when there are 2 GPUs, else gloo.

    python bench/guard_cost.py [--json out.json] [--reps 200]

Rows: per op, the median (over reps, of the slowest rank) µs of torch's own call, ours under compress="auto"
(native: no guard), ours under auto with PZ_CHECK_PLANS=1 (native + guard),
and ours under compress="never" (raw plan: guard + our algorithm).
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench import comm as comm_bench  # noqa: E402
from pzbench.common import machine_info, print_table  # noqa: E402


def _worker(rank, world, reps, numel):
    import portable_zip as pz

    dev = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.randn(numel, device=dev).to(torch.bfloat16)
    out = torch.empty(world * numel, dtype=t.dtype, device=dev)
    comms = {"auto": pz.Communicator(compress="auto", timeout=60)}
    os.environ["PZ_CHECK_PLANS"] = "1"
    comms["auto+check"] = pz.Communicator(compress="auto", timeout=60)
    del os.environ["PZ_CHECK_PLANS"]
    comms["never"] = pz.Communicator(compress="never", timeout=60)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    calls = {"torch": {"all_reduce": lambda: dist.all_reduce(t), "all_gather": lambda: ag(out, t)}}
    for name, c in comms.items():
        calls[name] = {"all_reduce": lambda c=c: c.all_reduce(t), "all_gather": lambda c=c: c.all_gather_single(out, t)}
    rows = []
    for op in ("all_reduce", "all_gather"):
        row = {"op": op, "bytes": t.nbytes}
        for name, fns in calls.items():
            fn = fns[op]
            for _ in range(10):
                fn()
            row[f"{name}_us"] = 1e6 * comm_bench.timed(fn, dev, reps)  # median of the slowest rank's times
        row["guard_us"] = row["auto+check_us"] - row["auto_us"]
        rows.append(row)
    plans = {n: {op: dict(s["plans"]) for op, s in c.stats.items()} for n, c in comms.items()}
    return {"rows": rows, "plans": plans, "backend": dist.get_backend()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--numel", type=int, default=2048)
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with 2 GPUs, else gloo)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    results = comm_bench.run_ranks(2, _worker, a.reps, a.numel, backend=a.backend)
    if any(s != "ok" for s, _ in results.values()):
        raise RuntimeError(f"benchmark workers failed: {results}")
    res = results[0][1]
    print_table(res["rows"], ["op", "bytes", "torch_us", "auto_us", "auto+check_us", "never_us", "guard_us"],
                f"per-op µs, 2 ranks over {res['backend']} (median of {a.reps})")
    doc = {"machine": machine_info(), **res}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
