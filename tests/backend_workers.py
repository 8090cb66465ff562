"""Per-rank bodies of the pz backend's tests: every op torch.distributed has,
called through dist.* on a "pz" group, against the same call on a plain
gloo group with the same inputs (importable by spawned processes)."""
from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist

import portable_zip as pz
from portable_zip.c10d import Options, ProcessGroupPZ
from conftest import same_bits as same

MODES = ("auto", "always", "never")
MOVED = (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.float8_e4m3fn)
REDUCED = (torch.bfloat16, torch.float16, torch.float32)


def data(seed, rank, case, numel, dtype):
    """What `rank` contributes to `case`: fresh per seed, different per rank and case (CPU)."""
    rng = np.random.default_rng([seed, rank, case])
    if dtype == torch.float8_e4m3fn:
        return torch.from_numpy(rng.uniform(-1, 1, numel).astype(np.float32)).to(dtype)
    if dtype in (torch.int64, torch.int32):
        return torch.from_numpy(rng.integers(-1000, 1000, numel)).to(dtype)
    return torch.from_numpy(rng.standard_normal(numel, dtype=np.float32) * 0.02).to(dtype)


_data = data


class Checker:
    def __init__(self):
        self.n, self.bad = 0, []

    def __call__(self, ok, what):
        self.n += 1
        if not ok:
            self.bad.append(what)


def every_op(rank, world, seed, numel, device="cpu", transport="auto"):
    """Each op on a "pz" group in each mode, beside the gloo group's result.
    device "cuda": every rank on the current GPU (transport="fabric" for
    ranks sharing one). Returns (checks run, failures, digests of the
    reductions per mode)."""
    dev = torch.device(device)
    ref = dist.new_group(backend="gloo")
    groups = {m: dist.new_group(backend="pz", pg_options=Options(compress=m, transport=transport)) for m in MODES}

    def data(*a):
        return _data(*a).to(dev)

    def empty(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device=dev)
    check = Checker()
    digests = {m: [] for m in MODES}
    for mode, g in groups.items():
        case = 0  # each mode moves the same tensors: their results must be the same bytes
        for dtype in MOVED:
            case += 1
            n = numel + case  # a different odd-ish size per case
            mine = data(seed, rank, case, n, dtype)
            for async_op in (False, True):
                # broadcast, from a different root each time
                src = (case + async_op) % world
                t = data(seed, src, case, n, dtype) if rank == src else empty(n, dtype=dtype)
                w = dist.broadcast(t, src, group=g, async_op=async_op)
                _finish(w, async_op, check, f"broadcast {mode} {dtype}")
                check(same(t, data(seed, src, case, n, dtype)), f"broadcast {mode} {dtype} async={async_op}")
                # all_gather_into_tensor and the list form
                out = empty(world * n, dtype=dtype)
                _finish(dist.all_gather_into_tensor(out, mine, group=g, async_op=async_op), async_op, check, "ag")
                want = torch.cat([data(seed, r, case, n, dtype) for r in range(world)])
                check(same(out, want), f"all_gather_into_tensor {mode} {dtype} async={async_op}")
                outs = [empty(n, dtype=dtype) for _ in range(world)]
                _finish(dist.all_gather(outs, mine, group=g, async_op=async_op), async_op, check, "agl")
                check(same(torch.cat(outs), want), f"all_gather {mode} {dtype} async={async_op}")
            # all_to_all_single with uneven splits (rows of 3), and the list form
            splits = [[(i * 7 + j * 3 + case) % 5 for j in range(world)] for i in range(world)]
            inp = data(seed, rank, case, sum(splits[rank]) * 3, dtype).reshape(-1, 3)
            out = empty(sum(splits[j][rank] for j in range(world)), 3, dtype=dtype)
            dist.all_to_all_single(out, inp, [splits[j][rank] for j in range(world)], splits[rank], group=g)
            want = torch.cat([data(seed, j, case, sum(splits[j]) * 3, dtype).reshape(-1, 3)
                              [sum(splits[j][:rank]): sum(splits[j][:rank + 1])] for j in range(world)])
            check(same(out, want), f"all_to_all_single uneven {mode} {dtype}")
            ins = list(torch.split(inp, splits[rank]))
            ins = [x.contiguous() for x in ins]
            outs = [empty(splits[j][rank], 3, dtype=dtype) for j in range(world)]
            dist.all_to_all(outs, ins, group=g)
            check(same(torch.cat(outs), want), f"all_to_all list {mode} {dtype}")
            # send/recv in a ring, isend/irecv and batch_isend_irecv
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            got = empty(n, dtype=dtype)
            ops = [dist.P2POp(dist.isend, mine, nxt, g), dist.P2POp(dist.irecv, got, prv, g)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            check(same(got, data(seed, prv, case, n, dtype)), f"batch_isend_irecv {mode} {dtype}")
            got2 = empty(n, dtype=dtype)
            if rank % 2 == 0:
                dist.send(mine, nxt, group=g)
                dist.recv(got2, prv, group=g)
            else:
                dist.recv(got2, prv, group=g)
                dist.send(mine, nxt, group=g)
            check(same(got2, data(seed, prv, case, n, dtype)), f"send/recv {mode} {dtype}")
            if dtype == torch.float8_e4m3fn:
                continue  # gloo moves no fp8: the forwarded ops below would fail in gloo itself
            # forwarded ops: gather, scatter (bit-identical to the inputs)
            dst = case % world
            gl = [empty(n, dtype=dtype) for _ in range(world)] if rank == dst else None
            dist.gather(mine, gl, dst=dst, group=g)
            if rank == dst:
                check(same(torch.cat(gl), torch.cat([data(seed, r, case, n, dtype) for r in range(world)])),
                      f"gather {mode} {dtype}")
            got3 = empty(n, dtype=dtype)
            sl = [data(seed, dst, case * 100 + r, n, dtype) for r in range(world)] if rank == dst else None
            dist.scatter(got3, sl, src=dst, group=g)
            check(same(got3, data(seed, dst, case * 100 + rank, n, dtype)), f"scatter {mode} {dtype}")
        for dtype in REDUCED:
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.AVG,
                       dist.ReduceOp.PRODUCT):
                case += 1
                n = numel + case
                mine = data(seed, rank, case, n, dtype)
                t = mine.clone()
                w = dist.all_reduce(t, op=op, group=g, async_op=True)
                fut = w.get_future()
                w.wait()
                check(w.is_completed() and fut.value()[0] is t, f"all_reduce Work/future {mode} {dtype} {op}")
                digests[mode].append(("all_reduce", t.view(torch.uint8).clone()))
                every = [data(seed, r, case, n, dtype) for r in range(world)]
                _reduced(check, t, mine, every, op, ref, f"all_reduce {mode} {dtype} {op}", mode)
                # reduce_scatter_tensor and the list form
                full = [data(seed, r, case * 10, world * n, dtype) for r in range(world)]
                if op == dist.ReduceOp.PRODUCT:
                    continue  # reduce_scatter's PRODUCT is forwarded like all_reduce's: checked above
                out = empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, full[rank].clone(), op=op, group=g)
                digests[mode].append(("reduce_scatter", out.view(torch.uint8).clone()))
                _reduced(check, out, None, [f[rank * n:(rank + 1) * n] for f in full], op, None,
                         f"reduce_scatter_tensor {mode} {dtype} {op}", mode)
                out2 = empty(n, dtype=dtype)
                dist.reduce_scatter(out2, [c.clone() for c in full[rank].split(n)], op=op, group=g)
                check(same(out, out2), f"reduce_scatter list == tensor form {mode} {dtype} {op}")
        # reduce (forwarded), barrier, object collectives
        t = data(seed, rank, 999, numel, torch.float32)
        dist.reduce(t, dst=0, op=dist.ReduceOp.MAX, group=g)
        if rank == 0:
            want = torch.stack([data(seed, r, 999, numel, torch.float32) for r in range(world)]).max(0).values
            check(same(t, want), f"reduce {mode}")
        dist.barrier(group=g)
        objs = [None] * world
        dist.all_gather_object(objs, {"rank": rank, "seed": seed, "mode": mode}, group=g)
        check(objs == [{"rank": r, "seed": seed, "mode": mode} for r in range(world)], f"all_gather_object {mode}")
        lst = [{"from": 0, "k": seed}] if rank == 0 else [None]
        dist.broadcast_object_list(lst, src=0, group=g)
        check(lst == [{"from": 0, "k": seed}], f"broadcast_object_list {mode}")
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(("r", rank), gathered, dst=0, group=g)
        if rank == 0:
            check(gathered == [("r", r) for r in range(world)], f"gather_object {mode}")
        got = [None]
        dist.scatter_object_list(got, [[r, seed] for r in range(world)] if rank == 0 else None, src=0, group=g)
        check(got == [[rank, seed]], f"scatter_object_list {mode}")
    stats = {m: g.stats for m, g in groups.items()}
    compressed = sum(s["wire_bytes"] < s["raw_bytes"] for st in stats["always"].values() for s in st.values()
                     if s["raw_bytes"])
    check(compressed > 0, f"compress='always' sent nothing compressed: {stats['always']}")
    never_coded = [op for st in stats["never"].values() for op, s in st.items() if "compressed" in s["plans"]]
    check(not never_coded, f"compress='never' coded {never_coded}")
    for g in groups.values():
        dist.destroy_process_group(g)
    return check.n, check.bad, {m: [(k, d.cpu().numpy().tobytes()) for k, d in ds] for m, ds in digests.items()}


def _finish(w, async_op, check, what):
    if async_op:
        check(w is not None, f"{what}: async_op=True returned no Work")
        w.wait()
        check(w.is_completed(), f"{what}: not completed after wait()")
    else:
        check(w is None, f"{what}: async_op=False returned {w!r}")


def _reduced(check, got, mine, every, op, ref_group, what, mode):
    """PRODUCT is forwarded: gloo's own bytes for the same inputs. MIN and
    MAX are exact. SUM and AVG: pz's plans (always, never) round once, from
    fp32 sums in rank order; auto may run gloo's own, which rounds at each of
    its world - 1 steps (docs/DROPIN.md)."""
    if op == dist.ReduceOp.PRODUCT:
        want = mine.cpu()
        dist.all_reduce(want, op=op, group=ref_group)
        check(same(got.cpu(), want), what)
        return
    got, every = got.cpu(), [e.cpu() for e in every]
    stack = torch.stack([e.double() for e in every])
    if op == dist.ReduceOp.MIN:
        check(same(got, stack.min(0).values.to(got.dtype)), what)
    elif op == dist.ReduceOp.MAX:
        check(same(got, stack.max(0).values.to(got.dtype)), what)
    else:
        want = stack.sum(0) / (len(every) if op == dist.ReduceOp.AVG else 1)
        eps = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}[got.dtype]
        err = (got.double() - want).abs()
        mass = stack.abs().sum(0)
        if mode == "auto":  # a rounding of each partial sum, each at most the inputs' mass
            bound = mass * eps * (len(every) - 1)
        else:  # one rounding of the result, plus fp32 accumulation's (far smaller)
            bound = want.abs() * eps * 1.001 + mass * 2 ** -22
        floor = torch.finfo(got.dtype).smallest_normal * eps  # half a subnormal step
        bad = err > bound + floor
        check(not bool(bad.any()), f"{what}: {int(bad.sum())} values off, e.g. {got[bad][:3].tolist()} "
                                   f"for {want[bad][:3].tolist()}")


def mismatch(rank, world, kind):
    """A program whose ranks disagree: every rank must raise, none may hang."""
    g = dist.new_group(backend="pz", pg_options=Options(compress="always", timeout=10.0))
    t0 = time.monotonic()
    try:
        if kind == "size":
            t = torch.zeros(1000 + 7 * (rank == 1), dtype=torch.bfloat16)
            dist.broadcast(t, 0, group=g)
        elif kind == "dtype":
            t = torch.zeros(1000, dtype=torch.bfloat16 if rank else torch.float16)
            dist.all_reduce(t, group=g)
        elif kind == "split":
            out = torch.empty(world, dtype=torch.float32)
            inp = torch.ones(world, dtype=torch.float32)
            splits = [1] * world if rank else [2] + [1] * (world - 2) + [0]
            dist.all_to_all_single(out, inp, None, splits, group=g)
        return ("no error", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, time.monotonic() - t0, str(e)[:300])


def killed_rank(rank, world, victim):
    """The victim dies before its part of an all_reduce; survivors must raise within the timeout."""
    g = dist.new_group(backend="pz", pg_options=Options(compress="always", timeout=5.0))
    t = data(1, rank, 1, 50_000, torch.bfloat16)
    dist.all_reduce(t.clone(), group=g)  # everyone alive: the Communicator exists
    if rank == victim:
        os._exit(17)
    t0 = time.monotonic()
    try:
        dist.all_reduce(t, group=g)
        return ("no error", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, time.monotonic() - t0, str(e)[:300])


def reinit(rank, world, port):
    """destroy_process_group, then a fresh "pz" world on a new port: both work."""
    import datetime
    out = []
    for round_ in range(2):
        if round_:
            dist.init_process_group("pz", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=60))
        t = data(round_, rank, 5, 30_000, torch.bfloat16)
        dist.all_reduce(t)
        every = torch.stack([data(round_, r, 5, 30_000, torch.bfloat16).double() for r in range(world)]).sum(0)
        out.append(bool(((t.double() - every).abs() <= every.abs() * 2 ** -8 * 1.01 + 1e-30).all()))
        out.append(str(dist.get_backend()))
        dist.destroy_process_group()
    return out


def unserved(rank, world):
    """What the backend cannot serve raises, naming the op or the option.
    Barriers first and last: both refusals are local, so without them a rank
    could finish and exit (taking the store it hosts) while its peer still
    builds the default group's inner groups."""
    dist.barrier()
    errs = []
    try:
        dist.recv(torch.empty(4), src=None)
    except Exception as e:  # noqa: BLE001
        errs.append(f"{type(e).__name__}: {e}")
    try:
        dist.new_group(backend="pz", pg_options={"compress": "always"})
    except Exception as e:  # noqa: BLE001
        errs.append(f"{type(e).__name__}: {e}")
    dist.barrier()
    return errs


def device_map(rank, world):
    """Under "cpu:gloo,cuda:pz" CPU tensors are gloo's alone; under "cpu:pz" they are ours."""
    pg = dist.group.WORLD
    t = data(3, rank, 3, 40_000, torch.bfloat16)
    dist.all_reduce(t)
    want = torch.stack([data(3, r, 3, 40_000, torch.bfloat16).double() for r in range(world)]).sum(0)
    close = bool(((t.double() - want).abs() <= want.abs() * 2 ** -8 * 1.001 + 1e-30).all())
    # a pz group, with or without the native gate (its subclass)
    name = "ProcessGroupPZ" if isinstance(pg, ProcessGroupPZ) else type(pg).__name__
    return name, sorted(pg.devices), sorted(pg.stats), close


def p2p_semantics(rank, world, seed, mode):
    """torch's matching: each send meets the peer's recv in posting order,
    whatever either side batches or waits on."""
    g = dist.new_group(backend="pz", pg_options=Options(compress=mode, timeout=30.0))
    check = Checker()
    n = 70_000  # above auto's native size: headed transfers
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    # 1. batched on the sender, one at a time on the receiver (a pipeline schedule's forward)
    if rank == 0:
        ws = [dist.isend(data(seed, 0, k, n, torch.bfloat16), 1, group=g) for k in range(3)]
        for w in ws:
            w.wait()
    elif rank == 1:
        for k in range(3):
            t = torch.empty(n, dtype=torch.bfloat16)
            dist.recv(t, 0, group=g)
            check(same(t, data(seed, 0, k, n, torch.bfloat16)), f"batched send {k}")
    # 2. crossed blocking-looking sends: both post a send first, then a recv
    if rank < 2:
        other = 1 - rank
        ws = dist.isend(data(seed, rank, 10, n, torch.float32), other, group=g)
        t = torch.empty(n, dtype=torch.float32)
        dist.recv(t, other, group=g)
        ws.wait()
        check(same(t, data(seed, other, 10, n, torch.float32)), "crossed")
    # 3. a ring through batch_isend_irecv, mixed sizes (native and headed) and dtypes in one batch
    outs = [(torch.bfloat16, n), (torch.float16, 100), (torch.float32, 3 * n + 1)]
    got = [torch.empty(m, dtype=d) for d, m in outs]
    ops = [dist.P2POp(dist.isend, data(seed, rank, 20 + i, m, d), nxt, g) for i, (d, m) in enumerate(outs)]
    ops += [dist.P2POp(dist.irecv, x, prv, g) for x in got]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    for i, (d, m) in enumerate(outs):
        check(same(got[i], data(seed, prv, 20 + i, m, d)), f"ring {d}")
    # 4. a recv waited on through its future only
    if rank < 2:
        if rank == 0:
            dist.send(data(seed, 0, 30, n, torch.bfloat16), 1, group=g)
        else:
            t = torch.empty(n, dtype=torch.bfloat16)
            w = dist.irecv(t, 0, group=g)
            w.get_future().wait()
            check(w.is_completed() and same(t, data(seed, 0, 30, n, torch.bfloat16)), "future")
    st = g.stats.get("cpu", {})
    plans = {op: dict(s["plans"]) for op, s in st.items() if op in ("send", "recv")}
    dist.destroy_process_group(g)
    return check.n, check.bad, plans


def p2p_mismatch(rank, world):
    """A recv whose tensor differs from the send raises on the receiver (as in torch)."""
    g = dist.new_group(backend="pz", pg_options=Options(compress="always", timeout=10.0))
    try:
        if rank == 0:
            dist.send(torch.zeros(100_000, dtype=torch.bfloat16), 1, group=g)
            return ("sent",)
        t = torch.empty(100_000, dtype=torch.float16)
        dist.recv(t, 0, group=g)
        return ("no error",)
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e)[:300])


def torch_paths(rank, world, seed):
    """What torch itself calls on a pz group: functional collectives and DTensor
    (all-gathers with no options), forwarded ops that fail, layouts that differ
    between ranks, and many forwarded ops in a row."""
    from torch.distributed._functional_collectives import all_gather_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = dist.group.WORLD
    out = []
    x = data(seed, rank, 1, 4096, torch.float32)
    got = all_gather_tensor(x, 0, g)
    out.append(same(got.wait() if hasattr(got, "wait") else got,
                    torch.cat([data(seed, r, 1, 4096, torch.float32) for r in range(world)])))
    mesh = init_device_mesh("cpu", (world,))
    full = data(seed, 0, 2, 64 * world, torch.bfloat16).reshape(world * 8, 8)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    out.append(same(dt.full_tensor(), full))
    # A forwarded op that fails in gloo leaves nothing behind: the next op runs.
    try:
        dist.all_reduce(torch.ones(4, dtype=torch.int16))
        out.append("no error")
    except TypeError as e:
        out.append("int16" in str(e) and "all_reduce" in str(e))
    t = data(seed, rank, 3, 1000, torch.float32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out.append(same(t, torch.stack([data(seed, r, 3, 1000, torch.float32) for r in range(world)]).max(0).values))
    # Layout differs between ranks: rank 0 contiguous, the others a strided view.
    base = data(seed, rank, 4, 2 * 3000, torch.bfloat16).reshape(3000, 2)
    v = base[:, 0] if rank else base[:, 0].contiguous()
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    want = torch.stack([data(seed, r, 4, 6000, torch.bfloat16).reshape(3000, 2)[:, 0].float()
                        for r in range(world)]).max(0).values.bfloat16()
    out.append(same(v.contiguous(), want))
    # A strided recv, small enough that auto moves it as torch's own recv.
    sent = data(seed, 0, 5, 1000, torch.float32)
    if rank == 0:
        dist.send(sent, 1)
        out.append(True)
    elif rank == 1:
        into = torch.zeros(1000, 2)[:, 1]
        dist.recv(into, 0)
        out.append(same(into.contiguous(), sent))
    else:
        out.append(True)
    # Forwarded ops are not held once done.
    for _ in range(50):
        dist.all_reduce(torch.ones(1000, dtype=torch.int64))
    out.append(len(g._running) <= 2)
    out.append(g.name())
    return out


def thin_native(rank, world, seed):
    """Ops that auto sends native, with nothing queued, take the backend's
    thin path: the Communicator's own op is never entered (here it raises),
    and the bytes equal gloo's. Returns (checks, mismatches, native plans)."""
    g = dist.new_group(backend="pz", pg_options=Options(compress="auto"))
    ref = dist.new_group(backend="gloo")
    dist.all_reduce(torch.zeros(8), group=g)  # makes the CPU Communicator (the full path)
    c = g.communicator("cpu")

    def refuse(*args, **kwargs):
        raise AssertionError("the Communicator's own op ran: the thin path was not taken")
    for name in ("all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single"):
        setattr(c, name, refuse)  # instance attributes shadow the methods
    check, case = Checker(), 0
    R = dist.ReduceOp
    for dtype in REDUCED:
        for numel in (world * 5, world * 1000 + world):
            for op in (R.SUM, R.MAX, R.MIN):
                for async_op in (False, True):
                    case += 1
                    outs = []
                    for grp in (g, ref):
                        t = data(seed, rank, case, numel, dtype)
                        w = dist.all_reduce(t, op=op, group=grp, async_op=async_op)
                        if async_op:
                            w.wait()
                        o = torch.empty(numel // world, dtype=dtype)
                        dist.reduce_scatter_tensor(o, data(seed, rank, case + 1000, numel, dtype), op=op, group=grp)
                        b = data(seed, rank, case + 2000, numel, dtype)
                        dist.broadcast(b, case % world, group=grp)
                        a = torch.empty(world * numel, dtype=dtype)
                        dist.all_gather_into_tensor(a, data(seed, rank, case + 3000, numel, dtype), group=grp)
                        # FSDP2's forms: the input is this rank's own slot of the output; AVG
                        a2 = torch.empty(world * numel, dtype=dtype)
                        mine = a2[rank * numel:(rank + 1) * numel]
                        mine.copy_(data(seed, rank, case + 4000, numel, dtype))
                        dist.all_gather_into_tensor(a2, mine, group=grp)
                        o2 = torch.empty(numel // world, dtype=dtype)
                        dist.reduce_scatter_tensor(o2, data(seed, rank, case + 5000, numel, dtype), op=R.AVG,
                                                   group=grp)
                        outs.append((t, o, b, a, a2, o2))
                    for what, x, y in zip(("all_reduce", "reduce_scatter", "broadcast", "all_gather",
                                           "all_gather in place", "reduce_scatter AVG"), *outs):
                        check(same(x, y), f"{what} {dtype} n={numel} {op} async={async_op}")
    plans = {op: dict(s["plans"]) for op, s in c.stats.items()}
    # FSDP2's pattern: async reduce_scatters (AVG), each waited. gloo's Work for
    # one never says it completed: none may stay held once waited for.
    x = data(seed, rank, 9999, world * 512, torch.bfloat16)
    for _ in range(50):
        o = torch.empty(512, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(o, x, op=R.AVG, group=g, async_op=True).wait()
    # Works stay torch's own (their futures and stream waits), but for gloo's reduce_scatter's.
    kinds = {}
    for what, post in (("all_reduce", lambda: dist.all_reduce(x, group=g, async_op=True)),
                       ("reduce_scatter", lambda: dist.reduce_scatter_tensor(o, x, group=g, async_op=True))):
        w = post()
        w.wait()
        kinds[what] = type(w).__name__
    return check.n, check.bad, plans, len(g._running), kinds
