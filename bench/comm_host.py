"""Host cost of the Communicator, two ranks on this machine.

1. Native plans: comm.<op> under compress="auto" (decided native) beside
   torch.distributed's own call on the same group, 4 KiB, median host time
   (until the call returns; NCCL returns once queued).
2. A compressed exchange: compress="always" send/recv of one 1 MiB bf16
   tensor, and of a batch of 64 x 64 KiB; wall time per exchange, and the
   Python host time inside it (cProfile: exchange's time minus its waits on
   the wire, on the device and on the transport), with where that goes.

--device cpu: gloo and the CPU codec. --device cuda: both ranks on GPU 0 over
the fabric transport (libfabric: NCCL refuses two ranks on one GPU).

    python3 -P bench/comm_host.py --device cuda --out bench/results/h200-comm-host.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench.common import machine_info  # noqa: E402
from harness.ranks import free_port  # noqa: E402  (on sys.path through pzbench)

def _median_us(fn, reps: int, sync, clock=time.perf_counter) -> float:
    """Median µs per call on clock: wall time, or time.thread_time for this thread's CPU time (its host work
    without the time it sleeps in waits, and without cProfile's overhead)."""
    times = []
    for _ in range(reps):
        sync()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return 1e6 * statistics.median(times)


def _profile(fn, n: int) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    st = pstats.Stats(prof)
    # The exchange: pipeline.exchange (4d84e45: wire.exchange, or wire.exchange_sized over the fabric).
    ex = [k for k in st.stats if (k[2], os.path.basename(k[0])) in
          (("exchange", "pipeline.py"), ("exchange", "wire.py"), ("exchange_sized", "wire.py"))]
    total = sum(st.stats[k][3] for k in ex)
    # Blocking callees anywhere below exchange: transports' wait and the device syncs.
    blocking = 0.0
    for (path, _l, name), (_cc, _nc, _tt, ct, _c) in st.stats.items():
        if (name == "wait" and os.path.basename(path) in ("torch.py", "fabric.py", "transport.py")) or name in (
                "<method 'item' of 'torch._C.TensorBase' objects>", "<method 'cpu' of 'torch._C.TensorBase' objects>",
                "<method 'synchronize' of 'torch._C._CudaEventBase' objects>"):
            blocking += ct
    top = sorted(((v[2], f"{os.path.basename(k[0])}:{k[1]}({k[2]})") for k, v in st.stats.items()), reverse=True)[:15]
    return {"exchange_us": 1e6 * total / n, "blocking_us": 1e6 * blocking / n,
            "python_host_us": 1e6 * (total - blocking) / n,
            "top_tottime_us": [(name, round(1e6 * t / n, 1)) for t, name in top]}


def _rank(rank: int, world: int, port: int, device: str, reps: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    os.environ.setdefault("PZ_FABRIC_PROVIDER", "tcp;ofi_rxm")  # loopback between the two ranks
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import portable_zip as pz

    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(0)
    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)
    transport = "fabric" if device == "cuda" else "torch"
    out = {}
    peer = 1 - rank
    # 1. Native plans (gloo/CPU only: over the fabric there is no torch op to compare with).
    if device == "cpu":
        comm = pz.Communicator(compress="auto", timeout=60)
        t = torch.zeros(2048, dtype=torch.bfloat16)
        g = torch.empty(world * t.numel(), dtype=t.dtype)
        grp = dist.new_group(list(range(world)), backend="gloo")  # torch's own group of the same ranks
        for name, ours, theirs in (
                ("all_reduce", lambda: comm.all_reduce(t), lambda: dist.all_reduce(t, group=grp)),
                ("broadcast", lambda: comm.broadcast(t, 0), lambda: dist.broadcast(t, 0, group=grp)),
                ("all_gather", lambda: comm.all_gather_single(g, t),
                 lambda: dist.all_gather_into_tensor(g, t, group=grp))):
            for _ in range(20):
                ours(), theirs()
            a, b = [], []
            for _ in range(5):  # interleaved rounds: drift hits both alike
                a.append(_median_us(ours, reps, sync))
                b.append(_median_us(theirs, reps, sync))
            out[f"native {name} 4KiB"] = {"pz_us": statistics.median(a), "torch_us": statistics.median(b),
                                           "over_torch_us": statistics.median(a) - statistics.median(b),
                                           "plans": comm.stats[name]["plans"]}
        comm.close()
    # 2. Compressed exchanges.
    comm = pz.Communicator(compress="always", transport=transport, device=dev, timeout=120)
    one = (torch.randn(1 << 19) * 0.02).to(torch.bfloat16).to(dev)
    got = torch.empty_like(one)
    batch = [(torch.randn(1 << 15) * 0.02).to(torch.bfloat16).to(dev) for _ in range(64)]
    gots = [torch.empty_like(b) for b in batch]

    def send_one():
        if rank == 0:
            comm.send(one, peer)
        else:
            comm.recv(got, peer)

    def send_batch():
        ws = [comm.isend(b, peer) for b in batch] if rank == 0 else [comm.irecv(g, peer) for g in gots]
        for w in ws:
            w.wait()

    for name, fn in (("1 x 1MiB bf16", send_one), ("64 x 64KiB bf16", send_batch)):
        for _ in range(5):
            fn()
        wall = _median_us(fn, reps, sync)
        cpu = _median_us(fn, reps, sync, time.thread_time)
        # A batch's exchange runs on the worker thread, out of this thread's profile: timed only.
        prof = _profile(fn, reps) if name.startswith("1 x") else None
        out[f"compressed send {name}" if rank == 0 else f"compressed recv {name}"] = {
            "wall_us": wall, "thread_cpu_us": cpu, "profile": prof}
    comm.close()
    q.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, a.device, a.reps, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(60)
    rec = {**machine_info(), "ranks": {str(r): v for r, v in sorted(res.items())}}
    print(json.dumps(rec, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
