"""What a receiver that posts late holds: two CPU ranks on loopback over the
fabric transport (tcp;ofi_rxm), rank 0 sends --mb MiB, rank 1 posts its
receive --late s later. Per PZ_FABRIC_WINDOW asked for (0: rendezvous;
1 GiB: a window larger than the send, i.e. eager chunks with no bound),
rank 1's RSS growth over its first second and over the rest of the wait,
and how long rank 0's send took.

    python3 -P bench/late_receiver.py [--mb 512] [--late 5] [--windows 0,1MiB,4MiB,1GiB] [--json OUT]
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench.common import fmt_size, parse_size, write_json  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(nbytes: int, late: float) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from portable_zip.comm.deadline import Deadline
    from portable_zip.comm.group import Group
    from portable_zip.comm.settings import Settings
    from portable_zip.comm.transports.fabric import FabricTransport

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    tp = FabricTransport(Group.of(dist.group.WORLD, 60), torch.device("cpu"), Settings.from_env(), False)
    tp.connect(Deadline(60))
    tp.wait(tp.post([("send", torch.ones(8, dtype=torch.uint8), 1 - rank),
                     ("recv", torch.empty(8, dtype=torch.uint8), 1 - rank)]), Deadline(30))
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        tp.wait(tp.post([("send", data, 1)]), Deadline(120))
        print(json.dumps({"send_s": time.monotonic() - t0, "push": tp.info.get("push")}), flush=True)
    else:
        got = torch.empty(nbytes, dtype=torch.uint8)
        before = _rss_mb()
        time.sleep(1.0)
        mid = _rss_mb()
        time.sleep(late - 1.0)
        end = _rss_mb()
        tp.wait(tp.post([("recv", got, 0)]), Deadline(120))
        print(json.dumps({"first_s_mb": mid - before, "later_mb": end - mid, "exact": bool(torch.equal(got, data))}),
              flush=True)
    dist.barrier()
    tp.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--late", type=float, default=5.0)
    p.add_argument("--windows", default="0,1MiB,4MiB,1GiB")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(int(a.worker[0]), float(a.worker[1]))
        return
    rows = []
    for w in a.windows.split(","):
        win = parse_size(w) if w != "0" else 0
        env = {**os.environ, "PZ_FABRIC_PROVIDER": "tcp;ofi_rxm", "PZ_FABRIC_WINDOW": str(win), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.abspath(__file__), "--worker", str(a.mb << 20), str(a.late)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode or len(got) != 2:
            sys.exit(f"window {w}: rc {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}")
        row = {"window": win, **got[0], **got[1]} if "send_s" in got[0] else {"window": win, **got[1], **got[0]}
        print(f"window {fmt_size(win) if win else '0 (rendezvous)'}: receiver grew {row['first_s_mb']:.1f} MB in its "
              f"first second, {row['later_mb']:.1f} MB over the next {a.late - 1:.0f} s; send took {row['send_s']:.2f} s; "
              f"exact {row['exact']}", flush=True)
        rows.append(row)
    if a.json:
        write_json(a.json, rows, {"mb": a.mb, "late_s": a.late, "what": "a receiver posting late: RSS growth "
                                  "(MB) while it waits, per push window; loopback, CPU ranks, tcp;ofi_rxm"})


if __name__ == "__main__":
    main()
