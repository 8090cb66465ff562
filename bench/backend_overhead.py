"""Per-op overhead of the "pz" torch.distributed backend against torch's own
backend (gloo), two CPU ranks on this machine, 4 KiB tensors: the same
dist.* call on a "pz" group (compress="auto": small ops run torch's own op)
and on a plain gloo group, interleaved: median wall time per blocking call,
and median CPU time of the calling thread (time.thread_time: the host work a
call costs, without the time it sleeps waiting for the wire).

    python3 -P bench/backend_overhead.py --out bench/results/cpu-backend-overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench.common import machine_info  # noqa: E402
from harness.ranks import free_port  # noqa: E402  (on sys.path through pzbench)


def _ops(world, rank):
    n = 4096 // 2
    t = torch.randn(n).bfloat16()
    out = torch.empty(world * n, dtype=torch.bfloat16)
    shard = torch.empty(n // world, dtype=torch.bfloat16)
    peer = rank ^ 1

    def p2p(g):
        if rank % 2 == 0:
            dist.send(t, peer, group=g)
        else:
            dist.recv(t, peer, group=g)
    return {
        "all_reduce": lambda g: dist.all_reduce(t, group=g),
        "broadcast": lambda g: dist.broadcast(t, 0, group=g),
        "all_gather_into_tensor": lambda g: dist.all_gather_into_tensor(out, t, group=g),
        "reduce_scatter_tensor": lambda g: dist.reduce_scatter_tensor(shard, t, group=g),
        "send/recv": p2p,
    }


class _Forward(dist.ProcessGroup):
    """The floor of any Python backend: each op handed to a gloo group as it
    is, with nothing else (what torch's dispatch into Python costs)."""

    def __init__(self, inner):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        # torch 2.13 names the single-tensor ops all_gather_single and
        # reduce_scatter_single; earlier releases _allgather_base and _reduce_scatter_base.
        self._gather = getattr(inner, "all_gather_single", None) or inner._allgather_base
        self._scatter = getattr(inner, "reduce_scatter_single", None) or inner._reduce_scatter_base

    def name(self):
        return "forward"

    def allreduce(self, tensors, opts):
        return self.inner.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        return self.inner.broadcast(tensors, opts)

    def all_gather_single(self, out, inp, opts):
        return self._gather(out, inp, opts)

    def reduce_scatter_single(self, out, inp, opts):
        return self._scatter(out, inp, opts)

    _allgather_base, _reduce_scatter_base = all_gather_single, reduce_scatter_single

    def send(self, tensors, dst, tag):
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self.inner.recv(tensors, src, tag)


def _rank(rank, world, port, iters, q):
    import portable_zip  # noqa: F401
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    ref = dist.new_group(backend="gloo")
    pz = dist.new_group(backend="pz")
    other = dist.new_group(backend="gloo")
    dist.Backend.register_backend("forward", lambda store, r, w, timeout: _Forward(other), devices=["cpu"])
    fwd = dist.new_group(backend="forward")
    res = {}
    ops = _ops(world, rank)
    for g in (ref, pz, fwd):
        for fn in ops.values():
            for _ in range(20):
                fn(g)  # warm-up (pz: the Communicator's construction and calibration)
    # The same op straight on the pz Communicator's private gloo group: the
    # backend's Python alone is pz minus this, whatever the group's threads cost.
    inner = pz.communicator("cpu").group
    t = torch.randn(2048).bfloat16()
    arms = {"gloo": lambda f: f(ref), "pz": lambda f: f(pz), "forward": lambda f: f(fwd)}
    for name, fn in ops.items():
        times = {k: [] for k in list(arms) + (["inner"] if name == "all_reduce" else [])}
        cpu = {k: [] for k in times}
        for i in range(iters):
            order = list(times) if i % 2 else list(reversed(times))  # neither arm always goes first
            for key in order:
                dist.barrier(group=ref)
                t0, c0 = time.perf_counter(), time.thread_time()
                if key == "inner":
                    inner.all_reduce(t, dist.ReduceOp.SUM).wait()
                else:
                    arms[key](fn)
                cpu[key].append(time.thread_time() - c0)
                times[key].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        cmed = {k: statistics.median(v) * 1e6 for k, v in cpu.items()}
        res[name] = {"gloo_us": round(med["gloo"], 1), "pz_us": round(med["pz"], 1),
                     "overhead_us": round(med["pz"] - med["gloo"], 1),
                     "gloo_cpu_us": round(cmed["gloo"], 1), "pz_cpu_us": round(cmed["pz"], 1),
                     "forward_us": round(med["forward"], 1), "forward_cpu_us": round(cmed["forward"], 1),
                     "pz_plans": {k: dict(v["plans"]) for k, v in pz.stats.get("cpu", {}).items()}}
        if "inner" in med:
            res[name]["pz_private_group_direct_us"] = round(med["inner"], 1)
    res["_native_gate"] = pz.native_gate
    q.put((rank, res))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--out")
    a = ap.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_rank, args=(r, 2, port, a.iters, q)) for r in range(2)]
    for p in ps:
        p.start()
    got = {}
    deadline = time.monotonic() + 600
    while len(got) < len(ps):  # a rank that dies fails the run now, not at the deadline
        try:
            r, res = q.get(timeout=1)
            got[r] = res
        except queue.Empty:
            dead = [i for i, p in enumerate(ps) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in ps:
                    p.kill()
                sys.exit(f"backend_overhead: rank {dead[0]} exited {ps[dead[0]].exitcode}" if dead
                         else "backend_overhead: no result within 600 s")
    for p in ps:
        p.join(60)
    how = got[0].pop("_native_gate")
    for r in got:
        got[r].pop("_native_gate", None)
    rows = {op: {"gloo_us": max(got[r][op]["gloo_us"] for r in got), "pz_us": max(got[r][op]["pz_us"] for r in got),
                 "gloo_cpu_us": max(got[r][op]["gloo_cpu_us"] for r in got),
                 "pz_cpu_us": max(got[r][op]["pz_cpu_us"] for r in got),
                 "forward_cpu_us": max(got[r][op]["forward_cpu_us"] for r in got),
                 "pz_private_group_direct_us": max(got[r][op].get("pz_private_group_direct_us", 0) for r in got),
                 "plans": got[0][op]["pz_plans"].get(op.split("/")[0].replace("_tensor", "").replace(
                     "_into", ""), {})} for op in got[0]}
    for op, r in rows.items():
        r["overhead_us"] = round(r["pz_us"] - r["gloo_us"], 1)
        r["cpu_overhead_us"] = round(r["pz_cpu_us"] - r["gloo_cpu_us"], 1)
        r["forward_cpu_overhead_us"] = round(r["forward_cpu_us"] - r["gloo_cpu_us"], 1)
        print(f"{op:24s} gloo {r['gloo_us']:8.1f} us   pz {r['pz_us']:8.1f} us   +{r['overhead_us']:6.1f} us  "
              f"thread CPU gloo {r['gloo_cpu_us']:6.1f} pz {r['pz_cpu_us']:6.1f} +{r['cpu_overhead_us']:5.1f} us "
              f"(a bare Python forwarder +{r['forward_cpu_overhead_us']:5.1f})  "
              f"(pz's private group direct {r['pz_private_group_direct_us']:.1f} us)  {r['plans']}")
    print(f"native ops: {how}")
    if a.out:
        doc = {"what": "per-op overhead of the pz backend vs gloo, 2 CPU ranks, 4 KiB bf16, median of blocking calls "
                       "(the slower rank's): wall, and the calling thread's CPU time", "command": " ".join([sys.executable, "-P"] + sys.argv),
               "machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "iters": a.iters, "ops": rows,
               "native_ops": how}
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
