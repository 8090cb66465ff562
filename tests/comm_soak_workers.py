"""Per-rank body of the communicator soak: thousands of random ops (op, dtype,
log-uniform size, mode), each checked against torch.distributed's own result
on the same inputs, with host RSS (and on CUDA, allocated GPU memory)
measured after a warm-up and at the end.

Backend-neutral: it runs on whatever group the harness made (gloo on CPU,
NCCL with backend="nccl", tensors on cuda:rank). The reference ops move uint8
views, so every dtype (fp8, int32) goes through every backend.
"""
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import portable_zip as pz
from portable_zip.comm.collectives import reduce_local
from harness.ranks import device

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.int32]
REDUCIBLE = [torch.bfloat16, torch.float16, torch.float32]
OPS = ["send_recv", "isend_batch", "broadcast", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
STAT = {"broadcast": "broadcast", "all_reduce": "all_reduce", "all_gather": "all_gather",
        "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all"}
# compress= modes; "auto-slow" tells auto the link is slow (0.5 GB/s) and the
# codec fast (latency fixed too: a loaded host measures it wildly), so its
# plan switches with the size.
MODES = {"auto": {"compress": "auto"}, "always": {"compress": "always"}, "never": {"compress": "never"},
         "auto-slow": {"compress": "auto", "link_gbps": 0.5, "latency_us": 50, "codec_gbps": 50}}
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def b(t):
    """uint8 view of a contiguous tensor (what the reference ops move)."""
    return t.reshape(-1).view(torch.uint8)


def same(a, c):
    return a.dtype == c.dtype and a.shape == c.shape and (a.numel() == 0 or torch.equal(b(a), b(c)))


class Fail(AssertionError):
    pass


def make(gen, numel, dtype, exact):
    """Random values: small integers when exact (sums of 3 ranks stay exact in
    every float dtype), else weight-like normals; int32 over its full range."""
    if dtype == torch.int32:
        t = torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32, generator=gen)
    elif exact:
        t = torch.randint(-8, 9, (numel,), generator=gen).to(dtype)
    else:
        scale = float(torch.empty(1).exponential_(generator=gen)) * 0.05
        t = (torch.randn(numel, generator=gen) * scale).to(dtype)
    return t.to(device())


def draw(rng, world, max_bytes):
    """One op, identical on every rank (rng is seeded alike)."""
    op = OPS[int(rng.integers(len(OPS)))]
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    if op in ("all_reduce", "reduce_scatter") and dtype not in REDUCIBLE:
        dtype = REDUCIBLE[int(rng.integers(len(REDUCIBLE)))]
    isz = torch.empty(0, dtype=dtype).element_size()
    nbytes = 0 if rng.random() < 0.03 else int(math.exp(rng.uniform(0, math.log(max_bytes))))
    numel = nbytes // isz
    spec = {"op": op, "dtype": dtype, "numel": numel, "exact": bool(rng.random() < 0.5),
            "redop": [pz.ReduceOp.SUM, pz.ReduceOp.MIN, pz.ReduceOp.MAX, pz.ReduceOp.AVG][int(rng.integers(4))],
            "async": bool(rng.random() < 0.2)}
    if op == "send_recv":
        src = int(rng.integers(world))
        spec["pair"] = (src, (src + 1 + int(rng.integers(world - 1))) % world)
    elif op == "broadcast":
        spec["src"] = int(rng.integers(world))
    elif op == "isend_batch":
        # sizes[i][j]: the tensors rank i sends to rank j (a different list per pair).
        spec["sizes"] = [[[int(math.exp(rng.uniform(0, math.log(max(numel, 2))))) for _ in range(int(rng.integers(1, 4)))]
                          for _ in range(world)] for _ in range(world)]
    elif op == "all_to_all":
        width = int(rng.integers(1, 9))
        rows = max(numel // width, 0)
        spec["width"] = width
        spec["splits"] = [[int(x) for x in rng.multinomial(rows, rng.dirichlet([0.5] * world))] for _ in range(world)]
    return spec


def describe(i, mode, s):
    keep = {k: v for k, v in s.items() if k not in ("sizes", "splits")}
    return f"op #{i} under {mode}: {keep}"


def run_op(comm, mode, spec, gen, rank, world, i):
    """Run one op through ours and through torch.distributed on the same inputs; raise Fail on any difference."""
    op, dt, n = spec["op"], spec["dtype"], spec["numel"]
    what = describe(i, mode, spec)
    if op == "send_recv":
        src, dst = spec["pair"]
        if rank == src:
            t = make(gen, n, dt, False)
            comm.send(t, dst)
            dist.send(b(t), dst)
        elif rank == dst:
            ours, ref = torch.empty(n, dtype=dt, device=device()), torch.empty(n, dtype=dt, device=device())
            comm.recv(ours, src)
            dist.recv(b(ref), src)
            if not same(ours, ref):
                raise Fail(f"{what}: received bytes differ from torch's")
        return
    if op == "isend_batch":
        sizes = spec["sizes"]
        outs = {p: [make(gen, k, dt, False) for k in sizes[rank][p]] for p in range(world) if p != rank}
        ours = {p: [torch.empty(k, dtype=dt, device=device()) for k in sizes[p][rank]] for p in range(world) if p != rank}
        refs = {p: [torch.empty(k, dtype=dt, device=device()) for k in sizes[p][rank]] for p in range(world) if p != rank}
        works = [comm.isend(t, p) for p, ts in outs.items() for t in ts]
        works += [comm.irecv(t, p) for p, ts in ours.items() for t in ts]
        for w in works:
            w.wait()
        p2p = [dist.P2POp(dist.isend, b(t), p) for p, ts in outs.items() for t in ts if t.numel()]
        p2p += [dist.P2POp(dist.irecv, b(t), p) for p, ts in refs.items() for t in ts if t.numel()]
        if p2p:
            for w in dist.batch_isend_irecv(p2p):
                w.wait()
        for p in ours:
            for k, (x, y) in enumerate(zip(ours[p], refs[p])):
                if not same(x, y):
                    raise Fail(f"{what}: tensor {k} from rank {p} differs from torch's")
        return
    before = dict(comm.stats.get(STAT[op], {}).get("plans", {}))
    aop = spec["async"]

    def done(work):
        if aop:
            work.wait()

    if op == "broadcast":
        src = spec["src"]
        ours = make(gen, n, dt, False) if rank == src else torch.empty(n, dtype=dt, device=device())
        ref = ours.clone()
        done(comm.broadcast(ours, src, async_op=aop))
        dist.broadcast(b(ref), src)
        ok = same(ours, ref)
    elif op == "all_gather":
        inp = make(gen, n, dt, False)
        ours = torch.empty(world * n, dtype=dt, device=device())
        ref = torch.empty_like(ours)
        done(comm.all_gather_single(ours, inp, async_op=aop))
        _all_gather(b(ref), b(inp))
        ok = same(ours, ref)
    elif op == "all_to_all":
        width, sp = spec["width"], spec["splits"]
        ins, outs = sp[rank], [sp[j][rank] for j in range(world)]
        inp = make(gen, sum(ins) * width, dt, False).reshape(-1, width)
        ours = torch.empty(sum(outs), width, dtype=dt, device=device())
        ref = torch.empty_like(ours)
        done(comm.all_to_all_single(ours, inp, outs, ins, async_op=aop))
        dist.all_to_all_single(ref.view(torch.uint8), inp.view(torch.uint8), outs, ins)
        ok = same(ours, ref)
    else:  # all_reduce, reduce_scatter
        redop, exact = spec["redop"], spec["exact"]
        if op == "all_reduce":
            inp = make(gen, n, dt, exact)
            ours = inp.clone()
            done(comm.all_reduce(ours, op=redop, async_op=aop))
        else:
            m = n // world
            inp = make(gen, m * world, dt, exact)
            ours = torch.empty(m, dtype=dt, device=device())
            done(comm.reduce_scatter_single(ours, inp, op=redop, async_op=aop))
        after = comm.stats[STAT[op]]["plans"]
        plan = next(p for p in after if after[p] != before.get(p, 0))
        if plan == "native" or (exact and redop != pz.ReduceOp.AVG):
            # torch's own reduction: the same native op, or exact inputs.
            if op == "all_reduce":
                ref = inp.clone()
                dist.all_reduce(ref, op=redop.native())
            else:
                ref = torch.empty_like(ours)
                _reduce_scatter(ref, inp, op=redop.native())
            ok = same(ours, ref)
            what += f" [{plan} plan; reference: torch.distributed]"
        else:
            # Ours: fp32 (fp64 for doubles) in rank order, one rounding: every rank alike.
            everyone = torch.empty(world * inp.numel(), dtype=dt, device=device())
            _all_gather(b(everyone), b(inp))
            parts = everyone.chunk(world) if inp.numel() else [inp] * world
            if op == "reduce_scatter":
                m = ours.numel()
                parts = [p[rank * m:(rank + 1) * m] for p in parts]
            ok = same(ours, reduce_local(list(parts), redop))
            what += f" [{plan} plan; reference: fp32 in rank order]"
    if not ok:
        raise Fail(f"{what}: result differs from the reference")


def soak(rank, world, seed, n_ops, max_bytes, modes=tuple(MODES), warm_at=None, timeout=120.0, every=0):
    """n_ops random ops; returns counts, timings and memory readings (also
    every `every` ops, in "trace", when every > 0). Every rank draws the same
    ops (rng seeded with seed) on its own data."""
    torch.manual_seed(seed)
    comms = {m: pz.Communicator(timeout=timeout, **MODES[m]) for m in modes}
    rng = np.random.default_rng([seed, 0])
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    warm_at = warm_at if warm_at is not None else max(n_ops // 10, 1)
    cuda = device().type == "cuda"
    readings, counts, moved = {}, {}, 0
    t0 = time.monotonic()
    for i in range(n_ops):
        if i == warm_at:
            readings["warm"] = mem(cuda)
            objs = object_counts()
            readings["warm_s"] = time.monotonic() - t0
        if every and i % every == 0:
            readings.setdefault("trace", []).append((i, mem(cuda), trimmed_rss_kib()))
        mode = list(modes)[int(rng.integers(len(modes)))]
        spec = draw(rng, world, max_bytes)
        try:
            run_op(comms[mode], mode, spec, gen, rank, world, i)
        except Fail as e:
            raise Fail(f"seed {seed}, rank {rank}: {e}") from None
        except Exception as e:
            raise Fail(f"seed {seed}, rank {rank}: {describe(i, mode, spec)} raised {type(e).__name__}: {e}") from e
        counts[spec["op"]] = counts.get(spec["op"], 0) + 1
        moved += spec["numel"] * torch.empty(0, dtype=spec["dtype"]).element_size()
    dist.barrier()
    readings["end"] = mem(cuda)
    if warm_at < n_ops:  # Python objects that grew in number since the warm-up (a leak's first suspects)
        now = object_counts()
        grown = sorted(((now[k] - objs.get(k, 0), k) for k in now), reverse=True)[:5]
        readings["objects_grown"] = [(k, n) for n, k in grown if n > 0]
    plans = {m: {op: s["plans"] for op, s in c.stats.items()} for m, c in comms.items()}
    for c in comms.values():
        c.close()
    return {"seed": seed, "ops": n_ops, "seconds": time.monotonic() - t0, "counts": counts, "bytes": moved,
            "plans": plans, **readings}


def trimmed_rss_kib():
    """VmRSS after glibc's malloc_trim(0): what the process holds once the
    allocator returns its free pages (a diagnostic beside the raw VmRSS)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return rss_kib()


def object_counts():
    import gc

    gc.collect()
    counts = {}
    for o in gc.get_objects():
        counts[type(o).__name__] = counts.get(type(o).__name__, 0) + 1
    return counts


def mem(cuda):
    """VmRSS, and VmRSS after malloc_trim(0) (a diagnostic: with glibc's
    default dynamic mmap threshold the raw figure swings ±15% between
    neighbouring ops); on CUDA, allocated GPU memory."""
    out = {"rss_kib": rss_kib(), "rss_trimmed_kib": trimmed_rss_kib()}
    if cuda:
        torch.cuda.synchronize()
        out["cuda_allocated"] = torch.cuda.memory_allocated()
    return out


def main():
    """python tests/comm_soak_workers.py [--nccl] [--world N] [--ops N] [--max-bytes N] [--modes a,b]"""
    import argparse
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import comm_harness
    import comm_soak_workers as csw

    ap = argparse.ArgumentParser()
    ap.add_argument("--nccl", action="store_true")
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--ops", type=int, default=int(os.environ.get("PZ_SOAK_OPS", 5000)))
    ap.add_argument("--max-bytes", type=int, default=8 << 20)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args()
    os.environ.setdefault("PZ_CHECK_PLANS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # the ranks inherit it: see test_comm_soak
    seed = a.seed if a.seed is not None else int(np.random.default_rng().integers(0, 2**31))
    res = comm_harness.run(a.world, csw.soak, seed, a.ops, a.max_bytes, tuple(a.modes.split(",")),
                           deadline=3600, backend="nccl" if a.nccl else "gloo")
    ok = True
    for r, (st, v) in sorted(res.items()):
        print(f"rank {r}: {st}: {v}")
        if st != "ok":
            ok = False
            continue
        w, e = v["warm"], v["end"]
        print(f"rank {r}: seed {seed}, {v['ops']} ops in {v['seconds']:.1f} s; RSS {w['rss_kib']} -> {e['rss_kib']} KiB, "
              f"trimmed {w['rss_trimmed_kib']} -> {e['rss_trimmed_kib']} KiB "
              f"({100 * (e['rss_trimmed_kib'] / w['rss_trimmed_kib'] - 1):+.1f}%)"
              + (f"; cuda allocated {w['cuda_allocated']} -> {e['cuda_allocated']} B" if "cuda_allocated" in w else ""))
        ok &= e["rss_kib"] <= 1.05 * w["rss_kib"]  # with MALLOC_MMAP_THRESHOLD_=65536 (see test_comm_soak)
        if "cuda_allocated" in w:  # GPU memory flat: every temporary of every op freed
            ok &= e["cuda_allocated"] <= w["cuda_allocated"]
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
