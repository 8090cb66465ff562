"""How long a survivor takes to notice a dead peer, per transport and case,
under the default timeout (300 s): the liveness watch (docs/TRANSPORT.md,
Liveness) against issue 27's finding that the fabric waited out the whole
timeout.

Cases (tests/comm_failure_workers.py's leave_and_wait; the last rank is the
victim, every survivor waits on it):
  exit   the victim's process ends before it sends
  kill   SIGKILL mid-transfer (each survivor sending it 128 MiB)
  stop   SIGSTOP: silent, its connections open (PZ_HEARTBEAT_TIMEOUT, 4 s)
A time is from the victim's leaving (its monotonic clock, the host's) to the
survivor's PeerError.

    python -P bench/liveness.py --out bench/results/cpu-liveness.json
    python -P bench/liveness.py --transports nccl --out bench/results/h200x2-liveness.json   (two GPUs)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench.common import machine_info  # noqa: E402  (puts tests/ on sys.path)

import comm_failure_workers as cfw  # noqa: E402
from harness.ranks import run_ranks  # noqa: E402

# name -> (Communicator transport=, torch backend of the job)
TRANSPORTS = {"gloo": ("torch", "gloo"), "fabric": ("fabric", "gloo"), "nccl": ("torch", "nccl")}


def one(name: str, case: str, world: int) -> dict:
    transport, backend = TRANSPORTS[name]
    with tempfile.TemporaryDirectory() as d:
        # PZ_SYNC_NATIVE: NCCL's native plans otherwise return with no host wait to raise in.
        res = run_ranks(world, cfw.liveness_rank, transport, case, os.path.join(d, "left"),
                        env={"OMP_NUM_THREADS": "1", "PZ_SYNC_NATIVE": "1"}, backend=backend, deadline=400,
                        pg_timeout=300)
    out = {"survivors": {}}
    for r, (status, value) in sorted(res.items()):
        if r == world - 1:
            continue
        if status != "ok" or value.get("outcome") != "raised":
            out["survivors"][r] = {"failed": f"{status}: {str(value)[:300]}"}
        else:
            out["survivors"][r] = {k: value[k] for k in ("noticed", "elapsed", "type", "msg")}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--transports", default="gloo,fabric" + (",nccl" if torch.cuda.device_count() >= 2 else ""))
    p.add_argument("--cases", default=",".join(cfw.LEAVE_CASES))
    p.add_argument("--worlds", default="2,3")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    load_before = os.getloadavg()
    rows = []
    for name in a.transports.split(","):
        for case in a.cases.split(","):
            for world in (int(w) for w in a.worlds.split(",")):
                if name == "nccl" and world > torch.cuda.device_count():
                    continue  # one GPU per rank
                runs = [one(name, case, world) for _ in range(a.reps)]
                times = [s["noticed"] for r in runs for s in r["survivors"].values() if "noticed" in s]
                failed = [s["failed"] for r in runs for s in r["survivors"].values() if "failed" in s]
                row = {"transport": name, "case": case, "world": world, "reps": a.reps,
                       "noticed_s": [round(t, 3) for t in times],
                       "median_s": round(statistics.median(times), 3) if times else None,
                       "max_s": round(max(times), 3) if times else None, "failed": failed,
                       "message": next((s["msg"] for r in runs for s in r["survivors"].values() if "msg" in s), None)}
                rows.append(row)
                print(f"{name:7s} {case:5s} world {world}: noticed in median {row['median_s']} s, "
                      f"max {row['max_s']} s over {len(times)} survivors" + (f"; {len(failed)} FAILED" if failed else ""),
                      flush=True)
    info = machine_info()
    info["heartbeat_timeout_s"] = float(os.environ.get("PZ_HEARTBEAT_TIMEOUT", 4))
    info["timeout_s"] = 300.0
    info["cpus"] = os.cpu_count()
    info["load_avg_1_5_15_before_after"] = [load_before, os.getloadavg()]  # other jobs share the host
    with open(a.out, "w") as f:
        json.dump({"machine": info, "rows": rows}, f, indent=1)
        f.write("\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
