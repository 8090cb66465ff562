"""Rank functions for tests/test_native_gate.py: the pz backend's native
gate (portable_zip/c10d/gate.cpp) against gloo's own ops."""
from __future__ import annotations

import torch
import torch.distributed as dist

from backend_workers import Checker, data, same
from portable_zip.c10d import Options


def gate_paths(rank, world, seed):
    """Native ops under auto, on fresh data per rank and case: blocking and
    async, several in flight, two on one tensor in a row, all_gather apart
    and in place, with full-path ops between them. Returns (checks, mismatches,
    ops the gate posted, native plans, how the group posts native ops)."""
    g = dist.new_group(backend="pz", pg_options=Options(compress="auto"))
    ref = dist.new_group(backend="gloo")
    dist.all_reduce(torch.zeros(8), group=g)  # makes the CPU Communicator
    check, case, ops = Checker(), 0, 0
    for rnd in range(40):
        for dtype in (torch.bfloat16, torch.float32):
            case += 1
            n = world * (1 + rnd % 3) * 97
            outs = []
            for grp in (g, ref):
                a = data(seed, rank, case, n, dtype)
                b = data(seed, rank, case + 1000, n, dtype)
                x = data(seed, rank, case + 2000, n, dtype)
                gathered = torch.empty(world * n, dtype=dtype)
                slot = torch.empty(world * n, dtype=dtype)
                slot[rank * n:(rank + 1) * n].copy_(data(seed, rank, case + 3000, n, dtype))
                async_op = rnd % 2 == 1 and grp is g  # gloo's own, blocking: its two threads may reorder
                ws = [dist.all_reduce(a, group=grp, async_op=async_op),
                      dist.all_reduce(a, op=dist.ReduceOp.MAX, group=grp, async_op=async_op),  # a again: in order
                      dist.broadcast(b, rnd % world, group=grp, async_op=async_op),
                      dist.all_gather_into_tensor(gathered, x, group=grp, async_op=async_op),
                      dist.all_gather_into_tensor(slot, slot[rank * n:(rank + 1) * n], group=grp,
                                                  async_op=async_op)]
                if rnd % 5 == 4:  # a full-path op between native ones: a strided tensor takes Python's path
                    s = data(seed, rank, case + 4000, 2 * n, dtype)[::2]
                    if grp is g:
                        dist.all_reduce(s, group=g)
                    else:  # gloo's reference on a contiguous copy (gloo takes dense tensors only)
                        c = s.contiguous()
                        dist.all_reduce(c, group=ref)
                        s.copy_(c)
                    ws.append(None)
                    outs.append((a, b, gathered, slot, s))
                else:
                    outs.append((a, b, gathered, slot))
                for w in ws:
                    if w is not None:
                        w.wait()
                        check(w.is_completed(), f"case {case}: not completed after wait()")
            ops += 5 + (rnd % 5 == 4)
            for i, (x, y) in enumerate(zip(*outs)):
                check(same(x.contiguous(), y.contiguous()), f"case {case} {dtype} n={n} output {i} async={rnd % 2 == 1}")
    mixed = g.gate_posted("cpu")
    # Steady blocking ops of one signature: Python runs the first, the gate every later one.
    t = data(seed, rank, 7777, world * 64, torch.bfloat16)
    want = t.clone()
    for _ in range(100):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        dist.all_reduce(want, op=dist.ReduceOp.MAX, group=ref)
    check(same(t, want), "steady all_reduce MAX")
    steady = g.gate_posted("cpu") - mixed
    plans = {op: dict(s["plans"]) for op, s in g.stats["cpu"].items()}
    return check.n, check.bad, (mixed, steady), plans, g.native_gate, ops


def gate_then_python(rank, world, seed):
    """A gate-posted async op, then Python's ops on the same storage: a full-path
    all_reduce of a strided view (it must wait for the gate's op) and a
    send/recv of the tensor; torch's sequence numbers still come from gloo.
    Returns (checks, mismatches, ops the gate posted)."""
    g = dist.new_group(backend="pz", pg_options=Options(compress="auto"))
    ref = dist.new_group(backend="gloo")
    check = Checker()
    n = world * 256
    for case in range(30):
        outs = []
        for grp in (g, ref):
            t = data(seed, rank, case, n, torch.float32)
            dist.all_reduce(t, group=grp)  # the first of its signature: Python's, then the gate opens
            w = dist.all_reduce(t, group=grp, async_op=grp is g)  # the gate's, in flight
            v = t[::2]
            if grp is g:
                dist.all_reduce(v, op=dist.ReduceOp.MAX, group=g)  # strided: Python's full path
            else:
                c = v.contiguous()
                dist.all_reduce(c, op=dist.ReduceOp.MAX, group=ref)
                v.copy_(c)
            if w is not None:
                w.wait()
            peer = rank ^ 1
            if peer < world:
                if rank % 2 == 0:
                    dist.send(t, peer, group=grp)
                else:
                    dist.recv(t, peer, group=grp)
            outs.append(t)
        check(same(*outs), f"case {case}")
    check(g._get_sequence_number_for_group() >= 0, "sequence number")
    return check.n, check.bad, g.gate_posted("cpu")
