"""The fabric's host cost per compressed exchange, as a Communicator
measures it at construction (compress="auto", transport="fabric":
calibration.measure_exchange): RUNS constructions, each on a fresh group so
no cached calibration is reused, on WORLD ranks of this machine over
loopback (tcp;ofi_rxm); each construction's agreed figure.

    python -P bench/host_exchange.py [--world 2] [--runs 3] [--device cpu|cuda] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench.comm import spawn  # noqa: E402
from pzbench.common import machine_info  # noqa: E402


def worker(rank, world, runs, device):
    import portable_zip as pz

    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU: the fabric stages through host memory
    figures = []
    for _ in range(runs):
        comm = pz.Communicator(dist.new_group(), compress="auto", transport="fabric", device=device, timeout=120)
        figures.append(comm.policy.cal.host_exchange_s)
        comm.close()
    return figures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    figures = spawn(a.world, worker, a.runs, a.device, env={"PZ_FABRIC_PROVIDER": "tcp;ofi_rxm"})
    print("host seconds per compressed exchange, each construction:", ", ".join(f"{s * 1e3:.2f} ms" for s in figures))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine_info(), "method": __doc__, "world": a.world, "device": a.device,
                       "host_exchange_s": figures}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
