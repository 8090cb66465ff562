"""One rank of a multi-node job, as torchrun starts it (tests/test_cluster.py):
env:// init over gloo, then DDP and FSDP2 trained on plain gloo and on the
"pz" backend (compress="always", transport="fabric"), each over a fresh
world, and this rank's parameter fingerprints and pz stats written to
OUT/rank<R>.json.

    torchrun --nnodes 2 --nproc-per-node 1 ... tests/cluster_worker.py OUT STEPS"""
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import training  # noqa: E402
from harness.training import Run  # noqa: E402


def main(out: str, steps: int) -> None:
    dist.init_process_group("gloo")  # env://, from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    training.STORE_HOST = os.environ["MASTER_ADDR"]
    runs = [Run(w, backend=b, compress="always", transport="fabric" if b == "pz" else "auto", steps=steps,
                values=False)
            for w in ("ddp", "fsdp") for b in ("gloo", "pz")]
    res = training.train(rank, world, runs)
    rows = [{"wrapping": r.wrapping, "backend": r.backend, "fingerprints": v["fingerprints"],
             "losses": v["losses"], "group_stats": v["group_stats"]} for r, v in zip(runs, res)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "host": os.uname().nodename, "runs": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
