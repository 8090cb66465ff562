"""bf16 weights (N(0, 0.02)) sent between two hosts over a shaped link
(network namespaces on this machine: portable_zip/netns.py, ci/netns): plain
torch.distributed send against pz.Communicator send with compress="auto" and
"always", every byte checked on the receiver, beside the link's limit as
plain TCP measures it. Needs root and iproute2.

    python -P bench/netns_link.py [--gbit 5 1] [--sizes 4M 16M 64M] [--reps 5] [--json OUT.json]
    (bench/results/cpu-netns-link.json: --reps 7)

Running any other job on the link (the FSDP2/DDP step over the pz backend, say):
  - a command, once per rank:
        ci/netns run --hosts 2 --per-host 1 --gbit 5 -- python -P train.py
    every rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
    (torch's env:// init) and gloo/libfabric bound to the link (netns.py says
    what else); `ci/netns measure --gbit 5` gives the limit to compare with.
  - from a script, as this one does: on_link(gbit, argv) builds the link,
    measures it, runs argv once per rank in it and returns the link's
    description, its limit and what each rank passed to netns.report(), in
    rank order. The script runs itself as the ranks (here: --worker JSON).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench import comm as comm_bench  # noqa: E402
from pzbench.common import parse_size, write_json  # noqa: E402

from portable_zip import netns  # noqa: E402


def on_link(gbit: float, argv: list, hosts: int = 2, per_host: int = 1, timeout: float = 600.0,
            env: dict = None, more: list = ()) -> tuple:
    """(description, measured limit, per-rank results) of argv run once per
    rank on a fresh link of gbit Gbit/s; raises with the ranks' output if one fails.
    more: further argvs run the same way one after another on the same link
    (fresh processes each); then the results are a list, one per argv."""
    with netns.Link(hosts, gbit=gbit) as link:
        limit = link.measure()
        print(f"link: {link.describe()}; plain TCP gets {limit['gbit']:.2f} Gbit/s, "
              f"round trip {limit['rtt_us']:.0f} us", flush=True)
        results = []
        for cmd in [argv, *more]:
            ranks = link.run(cmd, per_host=per_host, timeout=timeout, env=env)
            if any(ranks.codes):
                raise RuntimeError(f"ranks failed (exit codes {ranks.codes}):\n" + "\n".join(ranks.lines[-40:]))
            results.append(ranks.results())
        limit["gbit_after"] = link.measure()["gbit"]  # a busy machine shows here as a moved limit
        return link.describe(), limit, results if more else results[0]


def worker(sizes: list, reps: int) -> None:
    """One rank: each size as one tensor, rank 0 to rank 1, every mode (pzbench.comm.p2p_modes)."""
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    rows = []
    for size in sizes:
        t = comm_bench.weights(size // 2, torch.device("cpu"), seed=size)
        rows.append({"bytes": size, **comm_bench.p2p_modes(rank, [t], reps)})
    dist.destroy_process_group()
    netns.report({"rank": rank, "rows": rows, "torch_threads": torch.get_num_threads()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gbit", type=float, nargs="+", default=[5.0, 1.0], help="link rates, one run each")
    p.add_argument("--sizes", nargs="+", default=["4M", "16M", "64M"], help="bytes of bf16 per tensor")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(*json.loads(a.worker))
        return
    why = netns.unavailable()
    if why:
        sys.exit(f"bench/netns_link.py: no shaped link here: {why}")
    netns.exit_on_signals()
    sizes = [parse_size(s) for s in a.sizes]
    me = [sys.executable, "-P", os.path.abspath(__file__), "--worker", json.dumps([sizes, a.reps])]
    runs, load = [], os.getloadavg()  # other jobs on the machine move every figure here
    for gbit in a.gbit:
        desc, limit, res = on_link(gbit, me)
        rows = res[0]["rows"]  # rank 0's: times are the slower rank's, ratios and plans the sender's
        for r in rows:
            r["torch_gbit"] = r["bytes"] * 8 / r["torch_ms"] / 1e6
            r["torch_of_limit"] = r["torch_gbit"] / limit["gbit"]
            print(f"  {r['bytes'] >> 20:4d} MiB: torch {r['torch_ms']:8.1f} ms ({r['torch_gbit']:.2f} Gbit/s, "
                  f"{r['torch_of_limit']:.0%} of the limit)   auto {r['auto_ms']:8.1f} ms ({r['auto_speedup']:.2f}x)   "
                  f"always {r['always_ms']:8.1f} ms ({r['always_speedup']:.2f}x, ratio {r['always_ratio']:.3f})",
                  flush=True)
        runs.append({"link": desc, "configured_gbit": gbit, "limit": limit, "torch_threads": res[0]["torch_threads"],
                     "rows": rows})
    if a.json:
        tc = subprocess.run(["tc", "-V"], capture_output=True, text=True).stdout.strip()
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
        write_json(a.json, runs, {"host": {"kernel": platform.release(), "cores": os.cpu_count(), "cpu_model": model,
                                           "tc": tc, "load_avg_1_5_15_min": {"before": load, "after": os.getloadavg()}},
                                  "what": "rank 0 sends one N(0, 0.02) bf16 tensor to rank 1 in another network "
                                          "namespace over a tbf-shaped veth link; median of reps, slower rank's "
                                          "time; torch = batch_isend_irecv, auto/always = pz.Communicator "
                                          "isend/irecv; limit = plain TCP from host 0 to host 1"})


if __name__ == "__main__":
    main()
