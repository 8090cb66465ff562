"""Per-rank bodies of tests/test_c10d_failures.py (importable by forkserver
ranks), and scripts a test runs as whole interpreters (`python this.py
NAME`), where what it checks is how the process exits."""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

R = dist.ReduceOp
DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float8_e4m3fn)
REDUCTIONS = (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR)


def values(seed, rank, case, n, dtype):
    """Fresh inputs per seed, rank and case, small enough that no integer sum or product overflows."""
    rng = np.random.default_rng([seed, rank, case])
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n).astype(bool))
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.from_numpy(rng.integers(1, 4, n)).to(dtype)
    t = torch.from_numpy(rng.uniform(0.5, 2.0, n * (2 if dtype.is_complex else 1)).astype(np.float32))
    return torch.view_as_complex(t.view(n, 2)).to(dtype) if dtype.is_complex else t.to(dtype)


def _ops(rank, world, n):
    """name -> fn(group, make) -> output tensors; make(case, dtype, numel) gives this rank's inputs."""
    def all_reduce(op):
        def run(g, make):
            t = make(0, n)
            dist.all_reduce(t, op=op, group=g)
            return [t]
        return run

    def reduce(g, make):
        t = make(1, n)
        dist.reduce(t, 0, group=g)
        return [t] if rank == 0 else []

    def broadcast(g, make):
        t = make(2, n)
        dist.broadcast(t, 1, group=g)
        return [t]

    def all_gather(g, make):
        inp = make(3, n)
        outs = [torch.empty_like(inp) for _ in range(world)]
        dist.all_gather(outs, inp, group=g)
        return outs

    def all_gather_into_tensor(g, make):
        inp = make(4, n)
        out = torch.empty(world * n, dtype=inp.dtype)
        dist.all_gather_into_tensor(out, inp, group=g)
        return [out]

    def reduce_scatter(g, make):
        ins = [make(5 + r, n) for r in range(world)]
        out = torch.empty_like(ins[0])
        dist.reduce_scatter(out, ins, group=g)
        return [out]

    def reduce_scatter_tensor(g, make):
        inp = make(9, world * n)
        out = torch.empty(n, dtype=inp.dtype)
        dist.reduce_scatter_tensor(out, inp, group=g)
        return [out]

    def all_to_all_single(g, make):
        inp = make(10, world * n)
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp, group=g)
        return [out]

    def all_to_all(g, make):
        ins = [make(11 + r, n) for r in range(world)]
        outs = [torch.empty_like(i) for i in ins]
        dist.all_to_all(outs, ins, group=g)
        return outs

    def gather(g, make):
        inp = make(15, n)
        outs = [torch.empty_like(inp) for _ in range(world)] if rank == 0 else None
        dist.gather(inp, outs, 0, group=g)
        return outs or []

    def scatter(g, make):
        ins = [make(16 + r, n) for r in range(world)] if rank == 0 else None
        out = make(20, n)
        dist.scatter(out, ins, 0, group=g)
        return [out]

    def send_recv(g, make):
        t = make(21, n)
        if rank == 0:
            dist.send(t, 1, group=g)
            return []
        if rank == 1:
            dist.recv(t, 0, group=g)
        return [t]

    ops = {f"all_reduce {op}": all_reduce(op) for op in REDUCTIONS}
    ops.update(reduce=reduce, broadcast=broadcast, all_gather=all_gather,
               all_gather_into_tensor=all_gather_into_tensor, reduce_scatter=reduce_scatter,
               reduce_scatter_tensor=reduce_scatter_tensor, all_to_all_single=all_to_all_single,
               all_to_all=all_to_all, gather=gather, scatter=scatter, send_recv=send_recv)
    return ops


def _outcome(fn, g, make):
    try:
        return "ok", [t.clone() for t in fn(g, make)]
    except Exception as e:  # noqa: BLE001 - compared with gloo's outcome
        return "raised", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def gloo_parity(rank, world, seed, n, spec=None):
    """Every op and dtype on plain gloo and on pz groups of every mode: what
    gloo does, pz does, with the same bits (pz also moves dtypes gloo
    refuses). Under spec "cpu:gloo,cuda:pz", the default group's CPU ops are
    gloo's own: the same outcome, errors included. Returns (cases run,
    mismatches)."""
    from portable_zip.c10d import Options

    gloo = dist.new_group(backend="gloo")
    if spec is None:
        pz = {m: dist.new_group(backend="pz", pg_options=Options(compress=m)) for m in ("auto", "always", "never")}
    else:
        pz = {spec: dist.group.WORLD}
    bad, cases = [], 0
    ops = _ops(rank, world, n)
    if spec is not None:  # gloo's own, which pz refuses (it matches transfers per named peer)
        def recv_any(g, make):
            t = make(22, n)
            if rank == 0:
                dist.send(t, 1, group=g)
            elif rank == 1:
                return [t, torch.tensor([dist.recv(t, group=g)])]
            return []
        ops["recv from any source"] = recv_any
    for name, fn in ops.items():
        for dtype in DTYPES:
            def make(case, numel, dtype=dtype):
                return values(seed, rank, case, numel, dtype)
            want = _outcome(fn, gloo, make)
            for mode, g in pz.items():
                cases += 1
                got = _outcome(fn, g, make)
                if want[0] == "raised" and (spec is None or got[0] == "raised"):
                    continue  # pz may move what gloo cannot; under spec, both refused
                if want[0] != got[0]:
                    bad.append(f"{name} {dtype} {mode}: gloo {want[0]} ({want[1] if want[0] == 'raised' else ''}), "
                               f"pz {got[0]} ({got[1] if got[0] == 'raised' else ''})")
                elif want[0] == "ok" and not all(a.view(torch.uint8).equal(b.view(torch.uint8))
                                                 for a, b in zip(want[1], got[1])):
                    bad.append(f"{name} {dtype} {mode}: different bytes")
    return cases, bad


def _ints(seed, rank, case, n, dtype=torch.bfloat16):
    """Small integers: every sum below is exact in bf16, whatever the order of its additions."""
    rng = np.random.default_rng([seed, rank, case])
    return torch.from_numpy(rng.integers(-3, 4, n).astype(np.float32)).to(dtype)


def order(rank, world, seed, rounds, mode):
    """Async ops on one tensor, posted back to back, must run in call order:
    chains of all_reduces then a broadcast, an async op then a forwarded op,
    a point-to-point op, or an op of another plan. Sizes straddle auto's
    threshold (the policy's own choice, probed here), so its native and
    compressed plans meet on one tensor. Two ranks (the expected values
    assume them). Returns (wrong results, checks, plans seen)."""
    import portable_zip as pz
    from portable_zip.c10d import Options

    g = dist.new_group(backend="pz", pg_options=Options(compress=mode))
    dist.all_reduce(torch.zeros(8), group=g)  # makes the CPU Communicator
    sizes = [64, 4096]
    c = g.communicator("cpu")
    straddled = False
    if mode == "auto":
        n = 64
        while n < 1 << 22 and c.policy.choose("all_reduce", torch.bfloat16, 2 * n, world) == "native":
            n *= 2
        # The first compressed all_reduce, and either side of it. Where the policy
        # (calibrated on this machine, under its load) codes even the smallest
        # size, no native plan can meet a compressed one here: the caller is told.
        straddled = n > 64
        sizes = [n // 8, n // 2 + 1, n, 4 * n]
    wrong, checks = [], 0

    def expect(got, want, what):
        nonlocal checks
        checks += 1
        if not got.view(torch.int16).equal(want.view(torch.int16)):
            wrong.append(f"{what}: {int((got != want).sum())} of {got.numel()} differ")

    for i in range(rounds):
        for n in sizes:
            case = i * 100 + n % 97
            x = [_ints(seed, r, case, n) for r in range(world)]
            s = torch.stack([v.float() for v in x]).sum(0)
            # two all_reduces then a broadcast from rank 1, all async
            t = x[rank].clone()
            ws = [dist.all_reduce(t, group=g, async_op=True), dist.all_reduce(t, group=g, async_op=True),
                  dist.broadcast(t, 1 % world, group=g, async_op=True)]
            for w in ws:
                w.wait()
            expect(t, (s * world).to(t.dtype), f"all_reduce, all_reduce, broadcast n={n}")
            # an async all_reduce, then a forwarded op (PRODUCT) on the same tensor
            t = x[rank].clone()
            ws = [dist.all_reduce(t, group=g, async_op=True),
                  dist.all_reduce(t, op=R.PRODUCT, group=g, async_op=True)]
            for w in ws:
                w.wait()
            expect(t, (s ** world).to(t.dtype), f"all_reduce, forwarded PRODUCT n={n}")
            # an async broadcast, then point to point: rank 0's result reaches rank 1
            t = x[rank].clone()
            w = dist.broadcast(t, 0, group=g, async_op=True)
            if rank == 0:
                dist.send(t, 1, group=g)
            elif rank == 1:
                dist.recv(t, 0, group=g)
            w.wait()
            expect(t, x[0], f"broadcast, send/recv n={n}")
            # point to point then an async all_reduce of the received tensor
            t = x[rank].clone()
            ws = []
            if rank == 0:
                ws.append(dist.isend(x[0].clone(), 1, group=g))
            elif rank == 1:
                ws.append(dist.irecv(t, 0, group=g))
            ws.append(dist.all_reduce(t, group=g, async_op=True))
            for w in ws:
                w.wait()
            want = s - (x[1] if world > 1 else 0) + x[0]
            expect(t, want.to(t.dtype), f"irecv, all_reduce n={n}")
            # a non-contiguous tensor: its stand-in is copied when the second op is posted
            t = x[rank].clone()
            m = n // 2 * 2
            v = t[:m].view(2, m // 2).t()
            ws = [dist.all_reduce(v, group=g, async_op=True), dist.all_reduce(v, group=g, async_op=True)]
            for w in ws:
                w.wait()
            want = x[rank].clone()
            want[:m] = (s[:m] * world).to(t.dtype)
            expect(t, want, f"all_reduce x2 of a transposed view n={n}")
            # an async all_reduce, then an all_gather into a list (its input read when posted)
            t = x[rank].clone()
            outs = [torch.empty_like(t) for _ in range(world)]
            ws = [dist.all_reduce(t, group=g, async_op=True), dist.all_gather(outs, t, group=g, async_op=True)]
            for w in ws:
                w.wait()
            for o in outs:
                expect(o, s.to(t.dtype), f"all_reduce, all_gather list n={n}")
            # two forwarded ops on one tensor (gloo runs a group's async ops on two threads)
            t = x[rank].clone()
            p = torch.stack([v.float() for v in x]).prod(0)
            ws = [dist.all_reduce(t, op=R.PRODUCT, group=g, async_op=True),
                  dist.all_reduce(t, op=R.PRODUCT, group=g, async_op=True)]
            for w in ws:
                w.wait()
            expect(t, (p ** world).to(t.dtype), f"forwarded PRODUCT x2 n={n}")
    return wrong, checks, pz.stats(g).get("cpu", {}), straddled


def killed_ddp(rank, world, seed, mode, victim):
    """DDP over a pz group; the victim is SIGKILLed at a random moment of
    training (forward, backward, between steps). A survivor returns its
    error: (type, seconds after the kill was due, message), never crashes."""
    import random
    import signal
    import threading

    from torch.nn.parallel import DistributedDataParallel as DDP

    from portable_zip.c10d import Options

    g = dist.new_group(backend="pz", pg_options=Options(compress=mode, timeout=15.0))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    ddp = DDP(model, process_group=g, bucket_cap_mb=0.05)  # several buckets: several ops in flight
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        ddp(torch.randn(16, 128)).square().mean().backward()
        opt.step()
    step()  # every rank alive: the Communicator exists
    delay = random.Random(seed).uniform(0.0, 0.3)
    if rank == victim:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 60:
            step()
        return ("no error", 0.0, "")
    except Exception as e:  # noqa: BLE001 - the survivor's answer
        out = (type(e).__name__, round(time.monotonic() - t0 - delay, 2), str(e)[:400])
    time.sleep(1.0)  # every survivor meets the victim's death before any survivor leaves
    return out


def exit_after_stats(kind: str, mode: str, how: str) -> None:
    """A whole program (RANK, WORLD_SIZE, MASTER_* in the environment): DDP
    or FSDP2 over the pz world, the group's stats read, destroy_process_group,
    then Python's own exit, which must end with status 0."""
    import portable_zip as pz
    from portable_zip.c10d import Options

    dist.init_process_group("pz", pg_options=Options(compress=mode, timeout=60.0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, bucket_cap_mb=0.1)
    else:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(32, 256)).square().mean().backward()
        opt.step()
    g = dist.group.WORLD
    stats = pz.stats(g) if how == "pz.stats" else g.stats
    print("ops", sorted(stats["cpu"]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_after_stats(*sys.argv[1:])
