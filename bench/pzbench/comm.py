"""Communication benchmarks between local GPUs (or CPU processes): ours
(compress="auto" and "always") against plain torch.distributed, per link.

Links between two GPUs of one host, as NCCL settings (the figures are NCCL
send/recv between two H200s over NV18):
  nvlink-1ch  NCCL limited to one channel over NVLink, ~34 GB/s: NIC-like (primary)
  socket      NCCL socket transport over loopback, ~4-8 GB/s: the slow extreme
  nvlink      full NVLink, ~360 GB/s: auto must simply not lose
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from harness.ranks import run_ranks

LINKS = {
    "nvlink-1ch": {"NCCL_MAX_NCHANNELS": "1", "NCCL_MIN_NCHANNELS": "1"},
    "socket": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo",
               "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"},
    "nvlink": {},
}

# torch's own all_gather into one tensor (all_gather_single from torch 2.13 on).
TORCH_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def spawn(world: int, fn, *args, env=None, deadline: float = 580.0):
    """run_ranks for benchmarks: rank 0's result, or an error naming the failed ranks."""
    results = run_ranks(world, fn, *args, env=env, deadline=deadline)
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    if errors:
        raise RuntimeError(f"benchmark workers failed: {errors}")
    return results[0][1]


def weights(numel: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16).to(device)


def timed(fn, device, reps: int) -> float:
    """Median over reps of the slowest rank's time for fn()."""
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        times.append(el.item())
    return statistics.median(times)


def p2p_modes(rank: int, tensors, reps: int) -> dict:
    """Rank 0 sends every tensor to rank 1 as one batch: torch.distributed's
    batch_isend_irecv, then ours (compress="auto", "always": one isend/irecv
    group); rank 1 checks every bit. Median ms per mode, ours' wire ratio and plans."""
    import portable_zip as pz

    device = tensors[0].device
    recv = [torch.empty_like(t) for t in tensors]
    result = {}
    for mode in ("torch", "auto", "always"):
        comm = None if mode == "torch" else pz.Communicator(compress=mode)
        mine = tensors if rank == 0 else recv

        def move():
            if comm is None:
                op = dist.isend if rank == 0 else dist.irecv
                for w in dist.batch_isend_irecv([dist.P2POp(op, t, 1 - rank) for t in mine]):
                    w.wait()
            else:
                post = comm.isend if rank == 0 else comm.irecv
                for w in [post(t, 1 - rank) for t in mine]:
                    w.wait()

        move()  # warm-up
        result[f"{mode}_ms"] = timed(move, device, reps) * 1e3
        if rank == 1:
            assert all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                       for a, b in zip(tensors, recv)), f"{mode}: received tensors differ"
        if comm is not None and rank == 0:
            s = comm.stats.get("send", {})
            result[f"{mode}_ratio"] = s["wire_bytes"] / s["raw_bytes"] if s.get("raw_bytes") else 1.0
            result[f"{mode}_plans"] = s.get("plans")
    result["auto_speedup"] = result["torch_ms"] / result["auto_ms"]
    result["always_speedup"] = result["torch_ms"] / result["always_ms"]
    return result


def comm_worker(rank, world, sizes, ops, reps):
    import portable_zip as pz

    device = torch.device("cuda", rank) if torch.cuda.is_available() and dist.get_backend() == "nccl" else \
        torch.device("cpu")
    comms = {"auto": pz.Communicator(compress="auto"), "always": pz.Communicator(compress="always")}
    rows = []
    for size in sizes:
        numel = size // 2
        src = weights(numel, device, seed=rank)
        for op in ops:
            row = {"op": op, "bytes": size}
            for mode in ("torch", "always", "auto"):
                comm = comms.get(mode)
                if op == "send_recv":
                    buf = torch.empty_like(src)

                    def fn():
                        if mode == "torch":
                            dist.send(src, 1) if rank == 0 else dist.recv(buf, 0)
                        else:
                            comm.send(src, 1) if rank == 0 else comm.recv(buf, 0)
                elif op == "all_gather":
                    out = torch.empty(world * numel, dtype=src.dtype, device=device)

                    def fn():
                        if mode == "torch":
                            TORCH_ALL_GATHER(out, src)
                        else:
                            comm.all_gather_single(out, src)
                else:  # all_reduce
                    t = src.clone()

                    def fn():
                        if mode == "torch":
                            dist.all_reduce(t)
                        else:
                            comm.all_reduce(t)
                key = {"send_recv": "send", "all_gather": "all_gather", "all_reduce": "all_reduce"}[op]
                before = dict(comm.stats.get(key, {}).get("plans", {})) if comm is not None else {}
                fn()  # warm-up
                sec = timed(fn, device, reps)
                row[f"{mode}_ms"] = sec * 1e3
                row[f"{mode}_GBps"] = size / sec / 1e9
                if mode == "auto":  # the plan auto picked at this size (rank 0 sends for send_recv)
                    after = comm.stats.get(key, {}).get("plans", {})
                    grew = [p for p in after if after[p] > before.get(p, 0)]
                    row["auto_plan"] = "/".join(grew) or "-"
            rows.append(row)
    cal = comms["auto"].policy.cal
    return {"rows": rows, "calibration": cal.describe() if cal else None,
            "ratio": {str(k): v for k, v in comms["always"].policy.ratio.items()}}


def overhead_worker(rank, world, sizes, reps):
    """Per-call time (median µs, slowest rank) of small native ops through
    torch.distributed's entry points and through ours, to place host overhead:
    the sync call, async + wait(), async + polling is_completed(), a one-op
    batch_isend_irecv, and pz.Communicator(compress="auto")."""
    import portable_zip as pz

    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    comm = pz.Communicator(compress="auto")
    peer = 1 - rank

    def poll(w):
        while not w.is_completed():
            pass
        w.wait()

    def event_poll(w):
        w.wait()
        ev = torch.cuda.Event()
        ev.record()
        while not ev.query():
            pass

    rows = []
    for size in sizes:
        t = weights(size // 2, device, seed=rank)
        variants = {
            "all_reduce torch": lambda: dist.all_reduce(t),
            "all_reduce async+wait": lambda: dist.all_reduce(t, async_op=True).wait(),
            "all_reduce async+poll": lambda: poll(dist.all_reduce(t, async_op=True)),
            "all_reduce async+event-poll": lambda: event_poll(dist.all_reduce(t, async_op=True)),
            "all_reduce ours-auto": lambda: comm.all_reduce(t),
            "send torch": lambda: dist.send(t, peer) if rank == 0 else dist.recv(t, peer),
            "send isend+poll": lambda: poll(dist.isend(t, peer) if rank == 0 else dist.irecv(t, peer)),
            "send batch1+wait": lambda: [w.wait() for w in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, peer)])],
            "send batch1+poll": lambda: [poll(w) for w in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, peer)])],
            "send ours-auto": lambda: comm.send(t, peer) if rank == 0 else comm.recv(t, peer),
        }
        for name, fn in variants.items():
            if "poll" in name and device.type != "cuda":
                continue  # gloo's p2p works complete inside wait(), not by polling
            for _ in range(3):
                fn()
            rows.append({"variant": name, "bytes": size, "us": timed(fn, device, reps) * 1e6})
        # Host-side cost alone: back-to-back calls without a sync in between.
        if device.type == "cuda":
            for name in ("all_reduce torch", "all_reduce ours-auto"):
                fn = variants[name]
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                host = (time.perf_counter() - t0) / reps
                torch.cuda.synchronize()
                rows.append({"variant": name + " (enqueue loop)", "bytes": size, "us": host * 1e6})
    return {"rows": rows, "calibration": comm.policy.cal.describe() if comm.policy.cal else None}
