"""Effective throughput (raw bytes / time) of ours (compress="auto" and
"always") against plain torch.distributed, per link, 1 MiB to 1 GiB bf16
weight-like tensors. Needs 2 GPUs (falls back to 2 CPU processes over gloo).

    python bench/comm.py [--links nvlink-1ch,socket,nvlink] [--sizes 1MiB,...,1GiB] [--json out.json] [--png out.png]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench import comm as comm_bench  # noqa: E402
from pzbench.common import machine_info, parse_size, print_table  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--links", default="nvlink-1ch,socket,nvlink")
    p.add_argument("--sizes", default="1MiB,4MiB,16MiB,64MiB,256MiB,1GiB")
    p.add_argument("--ops", default="send_recv,all_gather,all_reduce")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--overhead", action="store_true",
                   help="per-call µs of small native ops through torch's entry points and ours")
    a = p.parse_args()
    if a.overhead:
        return overhead(a)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    doc = {"machine": machine_info(), "links": {}}
    for link in a.links.split(","):
        res = comm_bench.spawn(2, comm_bench.comm_worker, sizes, a.ops.split(","), a.reps, env=comm_bench.LINKS[link])
        for r in res["rows"]:
            r["link"] = link
            r["auto_vs_torch"] = r["auto_GBps"] / r["torch_GBps"]
            r["always_vs_torch"] = r["always_GBps"] / r["torch_GBps"]
        doc["links"][link] = res
        print_table(res["rows"], ["link", "op", "bytes", "torch_GBps", "always_GBps", "auto_GBps", "auto_plan",
                                  "always_vs_torch", "auto_vs_torch"],
                    f"{link}: effective GB/s (raw bytes / time); calibration: {res['calibration']}")
        sys.stdout.flush()
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    if a.png:
        plot(doc, a.png)


def overhead(a):
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    doc = {"machine": machine_info(), "links": {}}
    for link in a.links.split(","):
        res = comm_bench.spawn(2, comm_bench.overhead_worker, sizes, a.reps, env=comm_bench.LINKS[link])
        doc["links"][link] = res
        print_table(res["rows"], ["variant", "bytes", "us"], f"{link}: per-call time (median µs, slowest rank)")
        sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)


def plot(doc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(doc["links"])
    ops = sorted({r["op"] for l in links for r in doc["links"][l]["rows"]})
    fig, axes = plt.subplots(len(links), len(ops), figsize=(4.5 * len(ops), 3.4 * len(links)), squeeze=False)
    for i, link in enumerate(links):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            rows = [r for r in doc["links"][link]["rows"] if r["op"] == op]
            x = [r["bytes"] / 2**20 for r in rows]
            for mode, style in (("torch", "k--"), ("always", "b-o"), ("auto", "g-s")):
                ax.plot(x, [r[f"{mode}_GBps"] for r in rows], style, label=mode, markersize=3)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{link}: {op}", fontsize=9)
            ax.set_xlabel("MiB")
            ax.set_ylabel("effective GB/s")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
