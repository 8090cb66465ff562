"""Two ranks behind a shaped link, moving bytes both ways at once: the fabric
transport alone (one way, then both ways with each direction's completion
time) and a two-rank all_reduce under gloo and under pz (compress="never"
and "always" over the fabric), for each libfabric provider asked for. Where
pz's raw collectives trail gloo's on a link that binds, this shows which
layer loses the time (bench/NOTES.md, fifth session). Needs root and iproute2.

    python3 -P bench/both_ways.py [--gbit 10] [--mb 22.6] [--reps 10]
        [--providers "tcp;ofi_rxm,sockets"] [--json OUT.json]
    (bench/results/h100-raw-exchange-netns-10gbit.json: the same figures, from its first form)
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from netns_link import on_link  # noqa: E402
from pzbench.common import write_json  # noqa: E402

import portable_zip as pz  # noqa: E402
from portable_zip import netns  # noqa: E402
from portable_zip.comm.deadline import Deadline  # noqa: E402
from portable_zip.comm.group import Group  # noqa: E402
from portable_zip.comm.settings import Settings  # noqa: E402
from portable_zip.comm.transports.fabric import FabricTransport  # noqa: E402


def fabric_worker(nbytes: int, reps: int) -> None:
    """Rank 0 and 1 over the fabric transport alone: per rep, one way (rank 0
    to 1), then both ways at once with each direction's finish time."""
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    tp = FabricTransport(Group.of(dist.group.WORLD, 60), torch.device("cpu"), Settings.from_env(), False)
    tp.connect(Deadline(60))
    out = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    into = torch.empty(nbytes, dtype=torch.uint8)

    def wait(pending, t0, got, key):
        tp.wait(pending, Deadline(60))
        got[key] = 1e3 * (time.perf_counter() - t0)

    one, both = [], []
    for _ in range(reps + 1):  # the first rep connects: left out
        dist.barrier()
        t0 = time.perf_counter()
        tp.wait(tp.post([("send", out, peer)] if rank == 0 else [("recv", into, peer)]), Deadline(60))
        one.append(1e3 * (time.perf_counter() - t0))
        dist.barrier()
        t0, got = time.perf_counter(), {}
        pr, ps = tp.post([("recv", into, peer)]), tp.post([("send", out, peer)])
        th = threading.Thread(target=wait, args=(ps, t0, got, "send"))
        th.start()
        wait(pr, t0, got, "recv")
        th.join()
        both.append([got["send"], got["recv"]])
    tp.close()
    dist.destroy_process_group()
    netns.report({"rank": rank, "one_way_ms": one[1:], "both_ways_ms": both[1:], "provider": tp.info["provider"]})


def all_reduce_worker(mode: str, nbytes: int, reps: int) -> None:
    """A two-rank all_reduce of nbytes of fp32 under gloo, or pz with compress=mode over the fabric."""
    if mode == "gloo":
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    else:
        dist.init_process_group("pz", init_method="env://", timeout=timedelta(seconds=120),
                                pg_options=pz.c10d.Options(compress=mode, transport="fabric"))
    rank = dist.get_rank()
    x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank)) * 0.02
    ms = []
    for _ in range(reps + 2):  # the first two connect and calibrate: left out
        y = x.clone()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(y)
        ms.append(1e3 * (time.perf_counter() - t0))
    dist.destroy_process_group()
    netns.report({"rank": rank, "mode": mode, "ms": ms[2:]})


def _median(xs):
    return round(statistics.median(xs), 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gbit", type=float, default=10.0)
    p.add_argument("--mb", type=float, default=22.6, help="the all_reduce's MB of fp32; half of it moves each way")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--providers", default="tcp;ofi_rxm,sockets")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        kind, args = json.loads(a.worker)
        (fabric_worker if kind == "fabric" else all_reduce_worker)(*args)
        return
    why = netns.unavailable()
    if why:
        sys.exit(f"bench/both_ways.py: no shaped link here: {why}")
    netns.exit_on_signals()
    nbytes = int(a.mb * 1e6)

    def me(kind, *args):
        return [sys.executable, "-P", os.path.abspath(__file__), "--worker", json.dumps([kind, list(args)])]

    runs = []
    for prov in a.providers.split(","):
        env = {"PZ_FABRIC_PROVIDER": prov}
        cmds = [me("fabric", nbytes // 2, a.reps)] + [me("all_reduce", m, nbytes, a.reps) for m in ("never", "always")]
        desc, limit, (fab, never, always) = on_link(a.gbit, cmds[0], env=env, more=cmds[1:])
        row = {"provider": prov, "link": desc, "limit": limit, "bytes_each_way": nbytes // 2,
               "one_way_ms": fab[0]["one_way_ms"], "both_ways_ms": fab[0]["both_ways_ms"],
               "pz_never_ms": never[0]["ms"], "pz_always_ms": always[0]["ms"]}
        line_ms = nbytes / 2 * 8 / (limit["gbit"] * 1e6)
        print(f"{prov}: {nbytes // 2 / 1e6:.1f} MB one way {_median(row['one_way_ms'])} ms, both ways "
              f"{_median([max(b) for b in row['both_ways_ms']])} ms (the limit's rate: {line_ms:.1f}); all_reduce "
              f"pz never {_median(row['pz_never_ms'])} ms, always {_median(row['pz_always_ms'])} ms", flush=True)
        runs.append(row)
    _desc, _limit, gloo = on_link(a.gbit, me("all_reduce", "gloo", nbytes, a.reps))
    print(f"gloo all_reduce {_median(gloo[0]['ms'])} ms", flush=True)
    if a.json:
        write_json(a.json, runs, {"gloo_all_reduce_ms": gloo[0]["ms"], "mb": a.mb, "gbit": a.gbit,
                                  "fabric_env": {k: v for k, v in os.environ.items() if k.startswith(("PZ_FABRIC", "FI_"))},
                                  "what": "two ranks in two network namespaces over a tbf-shaped link, CPU "
                                          "tensors: the fabric transport one way and both ways at once (rank 0's "
                                          "[send, receive] finish times), and a two-rank all_reduce of fp32, ms"})


if __name__ == "__main__":
    main()
