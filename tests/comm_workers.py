"""Per-rank bodies of the communicator tests (importable by spawned processes)."""
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import portable_zip as pz
from conftest import same_bits as same

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
REDUCIBLE = [torch.bfloat16, torch.float16, torch.float32]


def device():
    """cuda:rank on NCCL groups, cpu on gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def empty(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device=device())


def data(seed, rank, case, numel, dtype, integer=False):
    """The tensor rank `rank` contributes to case `case`: any rank can rebuild it."""
    rng = np.random.default_rng([seed, rank, case])
    v = rng.integers(-8, 9, numel).astype(np.float32) if integer else rng.standard_normal(numel, dtype=np.float32) * 0.02
    return torch.from_numpy(v).to(dtype).to(device())


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def battery(rank, world, seed, sizes):
    """Every op, every dtype, several sizes, compress="always" and "never";
    returns the number of checks that passed."""
    comms = {m: pz.Communicator(compress=m, timeout=60) for m in ("always", "never")}
    passed, case = 0, 0
    for dtype in DTYPES:
        for numel in sizes:
            case += 1
            results = {}
            for mode, comm in comms.items():
                # Ring send/recv, posted async so no rank blocks the ring.
                nxt, prv = (rank + 1) % world, (rank - 1) % world
                got = empty(numel, dtype=dtype)
                w1 = comm.isend(data(seed, rank, case, numel, dtype), nxt)
                w2 = comm.irecv(got, prv)
                w1.wait(), w2.wait()
                check(same(got, data(seed, prv, case, numel, dtype)), f"send/recv {mode} {dtype} {numel}")
                # Broadcast.
                src = case % world
                t = data(seed, src, case, numel, dtype) if rank == src else empty(numel, dtype=dtype)
                comm.broadcast(t, src)
                check(same(t, data(seed, src, case, numel, dtype)), f"broadcast {mode} {dtype} {numel}")
                # All-gather.
                out = empty(world * numel, dtype=dtype)
                comm.all_gather_single(out, data(seed, rank, case, numel, dtype))
                want = torch.cat([data(seed, r, case, numel, dtype) for r in range(world)])
                check(same(out, want), f"all_gather {mode} {dtype} {numel}")
                # Uneven all_to_all over rows of 3 elements.
                splits = [[(i + j + case) % 4 * (numel % 7 + 1) for j in range(world)] for i in range(world)]
                inp = data(seed, rank, case, sum(splits[rank]) * 3, dtype).reshape(-1, 3)
                out = empty(sum(splits[j][rank] for j in range(world)), 3, dtype=dtype)
                comm.all_to_all_single(out, inp, [splits[j][rank] for j in range(world)], splits[rank])
                want = torch.cat([data(seed, j, case, sum(splits[j]) * 3, dtype).reshape(-1, 3)
                                  [sum(splits[j][:rank]): sum(splits[j][:rank + 1])] for j in range(world)])
                check(same(out, want), f"all_to_all {mode} {dtype} {numel}")
                passed += 4
                if dtype in REDUCIBLE:
                    for op in pz.ReduceOp:
                        t = data(seed, rank, case, numel, dtype)
                        comm.all_reduce(t, op=op)
                        results[(mode, "all_reduce", op)] = t
                        out = empty(numel, dtype=dtype)
                        comm.reduce_scatter_single(out, data(seed, rank, case, world * numel, dtype), op=op)
                        results[(mode, "reduce_scatter", op)] = out
            # Compressed and raw runs of the same algorithm agree bit for bit.
            for (mode, name, op), t in results.items():
                if mode == "always":
                    check(same(t, results[("never", name, op)]), f"{name} {op} always != never for {dtype} {numel}")
                    passed += 1
    # All ranks end with identical all_reduce bytes, and integer-valued floats
    # match torch.distributed's own all_reduce.
    for dtype in REDUCIBLE:
        for op in pz.ReduceOp:
            if op == pz.ReduceOp.AVG and world not in (2, 4):
                continue  # averages of integers are exact only for power-of-two world sizes
            case += 1
            mine = data(seed, rank, case, 10_007, dtype, integer=True)
            ours = mine.clone()
            comms["always"].all_reduce(ours, op=op)
            theirs = mine.clone()
            dist.all_reduce(theirs, op=op.native())
            check(same(ours, theirs), f"integer all_reduce {op} {dtype} differs from torch.distributed")
            everyone = empty(world * ours.numel(), dtype=dtype)
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(everyone, ours)
            check(all(same(c, ours) for c in everyone.chunk(world)), "ranks ended with different bytes")
            passed += 2
    stats = comms["always"].stats
    check(stats["all_reduce"]["wire_bytes"] < stats["all_reduce"]["raw_bytes"], f"no compression: {stats}")
    check(stats["all_gather"]["plans"] == {"compressed": stats["all_gather"]["calls"]}, f"plans: {stats}")
    return passed


def async_ops(rank, world, seed):
    """Collectives with async_op=True return a Work; queued ops run in posting order."""
    comm = pz.Communicator(compress="always", timeout=60)
    g = empty(world * 30_001, dtype=torch.bfloat16)
    t = data(seed, rank, 1, 70_001, torch.float32)
    b = data(seed, 0, 2, 10_000, torch.float16) if rank == 0 else empty(10_000, dtype=torch.float16)
    works = [comm.all_gather_single(g, data(seed, rank, 0, 30_001, torch.bfloat16), async_op=True),
             comm.all_reduce(t, async_op=True),
             comm.broadcast(b, 0, async_op=True)]
    check(all(isinstance(w, pz.Work) for w in works), "async ops return Work")
    for w in works:
        check(w.wait() is True, "wait() returns True")
        check(w.is_completed(), "completed after wait")
    check(same(g, torch.cat([data(seed, r, 0, 30_001, torch.bfloat16) for r in range(world)])), "async all_gather")
    check(same(b, data(seed, 0, 2, 10_000, torch.float16)), "async broadcast")
    ref = data(seed, rank, 1, 70_001, torch.float32)
    comm.all_reduce(ref)  # the same algorithm, blocking: identical bytes
    check(same(t, ref), "async all_reduce equals the blocking one")
    return True


def p2p_batch(rank, world, seed, wave_bytes):
    """Groups of many isend/irecv per peer (a state dict, KV blocks) in a ring:
    mixed dtypes, sizes 0 and odd, pieces, several waves; bit-exact, and the
    group's stats count every tensor."""
    import portable_zip.comm.wire as wire

    wire.WAVE_BYTES = wave_bytes
    rng = np.random.default_rng([seed, 99])
    specs = [(DTYPES[int(rng.integers(len(DTYPES)))], int(n)) for n in
             [0, 1, 3, 4097, *rng.integers(1, 40_000, 9), 70_001]]
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for mode in ("always", "never"):
        comm = pz.Communicator(compress=mode, timeout=60)
        got = [empty(n, dtype=dt) for dt, n in specs]
        works = [comm.isend(data(seed, rank, 100 + i, n, dt), nxt) for i, (dt, n) in enumerate(specs)]
        works += [comm.irecv(g, prv) for g in got]
        for w in works:
            w.wait()
        for i, ((dt, n), g) in enumerate(zip(specs, got)):
            check(same(g, data(seed, prv, 100 + i, n, dt)), f"{mode}: tensor {i} ({dt}, {n}) differs")
        st = comm.stats
        check(st["send"]["calls"] == len(specs) and st["recv"]["calls"] == len(specs), f"stats count tensors: {st}")
        if mode == "always":
            check(st["send"]["wire_bytes"] < st["send"]["raw_bytes"], f"batch not compressed: {st}")
    return True


def auto_policy(rank, world):
    """compress="auto" on a CPU/gloo group: the codec is slower than loopback, so
    the policy must pick the native plan; overrides flip it."""
    comm = pz.Communicator(compress="auto", timeout=60)
    t = torch.randn(1 << 20).to(torch.bfloat16).to(device())
    ref = t.clone()
    comm.all_reduce(t)
    dist.all_reduce(ref)
    check(comm.stats["all_reduce"]["plans"] == {"native": 1}, f"auto on loopback: {comm.stats}")
    check(same(t, ref), "native plan must equal torch.distributed")
    # The other native paths (uint8 views, so fp8 moves on gloo too), on a
    # communicator told its codec is far too slow to pay.
    comm = pz.Communicator(compress="auto", timeout=60, codec_gbps=1e-4)
    for dtype in (torch.bfloat16, torch.float8_e5m2):
        x = data(7, rank, 1, 5000, dtype)
        b = x.clone() if rank == 1 else empty(5000, dtype=dtype)
        comm.broadcast(b, 1)
        check(same(b, data(7, 1, 1, 5000, dtype)), f"native broadcast {dtype}")
        g = empty(world * 5000, dtype=dtype)
        comm.all_gather_single(g, x)
        check(same(g, torch.cat([data(7, r, 1, 5000, dtype) for r in range(world)])), f"native all_gather {dtype}")
        a2a = empty(5000, 1, dtype=dtype)
        splits = [2500, 2500]
        comm.all_to_all_single(a2a, x.reshape(5000, 1), splits, splits)
        want = torch.cat([data(7, r, 1, 5000, dtype)[rank * 2500:(rank + 1) * 2500] for r in range(world)])
        check(same(a2a.reshape(-1), want), f"native all_to_all {dtype}")
    rs = empty(t.numel() // world, dtype=t.dtype)
    comm.reduce_scatter_single(rs, t)
    plans = {op: s["plans"] for op, s in comm.stats.items()}
    check(all(set(p) == {"native"} for p in plans.values()), f"auto on loopback picks native: {plans}")
    # A slow link (0.05 GB/s) with a fast codec makes compression pay.
    slow = pz.Communicator(compress="auto", timeout=60, link_gbps=0.05, latency_us=50, codec_gbps=50)
    out = empty(world * t.numel(), dtype=t.dtype)
    slow.all_gather_single(out, t)
    check(slow.stats["all_gather"]["plans"] == {"compressed": 1}, f"auto on slow link: {slow.stats}")
    check(all(same(c, t) for c in out.chunk(world)), "all_gather result")
    return comm.backend


def dead_peer(rank, world, timeout):
    comm = pz.Communicator(compress="always", timeout=timeout)
    dist.barrier()
    if rank == world - 1:
        os._exit(0)  # dies without a word
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.randn(100_000).to(torch.bfloat16).to(device()))
    except pz.PeerError as e:
        return time.monotonic() - t0, type(e).__name__, str(e)
    raise AssertionError("all_reduce with a dead peer returned")


def corrupt_peer(rank, world):
    """A peer whose stream header is garbled (a bad format version): the
    receiver raises PeerError naming it, within the timeout; nothing hangs."""
    import portable_zip.codec as codec

    comm = pz.Communicator(compress="always", timeout=5)
    t0 = time.monotonic()
    if rank == 0:
        good = codec._compress_padded

        def garbled(t, *args, **kwargs):
            buf = good(t, *args, **kwargs)
            buf[4] = 99  # the header's format version byte
            return buf

        codec._compress_padded = garbled
        try:
            comm.send(data(1, 0, 0, 50_000, torch.bfloat16), 1)
        except Exception as e:  # noqa: BLE001 - on CPU the sender reads its own garbled size back and fails too
            return time.monotonic() - t0, type(e).__name__
        return time.monotonic() - t0, "sent"
    try:
        comm.recv(empty(50_000, dtype=torch.bfloat16), 0)
    except pz.PeerError as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError("a garbled stream was accepted")


def hung_peer(rank, world, timeout):
    comm = pz.Communicator(compress="always", timeout=timeout)
    dist.barrier()
    if rank == 1:
        time.sleep(timeout * 4)  # alive but silent
        return None
    t0 = time.monotonic()
    try:
        comm.recv(empty(1000, dtype=torch.bfloat16), 1)
    except pz.PeerTimeout as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError("recv from a silent peer returned")


def mismatch(rank, world, kind):
    import portable_zip.comm.communicator as cm
    import portable_zip.comm.wire as wire

    comm = pz.Communicator(compress="always", timeout=30)
    try:
        if kind == "p2p_size":
            if rank == 0:
                comm.send(torch.zeros(100, dtype=torch.bfloat16, device=device()), 1)
            else:
                comm.recv(torch.zeros(99, dtype=torch.bfloat16, device=device()), 0)
        elif kind == "p2p_dtype":
            if rank == 0:
                comm.send(torch.zeros(100, dtype=torch.bfloat16, device=device()), 1)
            else:
                comm.recv(torch.zeros(100, dtype=torch.float16, device=device()), 0)
        elif kind == "collective_size":
            comm.all_reduce(torch.zeros(100 + rank, dtype=torch.float32, device=device()))
        elif kind == "collective_dtype":
            comm.all_gather_single(empty(world * 10, dtype=DTYPES[rank]), torch.zeros(10, dtype=DTYPES[rank], device=device()))
        elif kind == "version":
            if rank == 1:
                wire.WIRE_VERSION = cm.WIRE_VERSION = wire.WIRE_VERSION + (1 << 8)  # a peer on format v2
            comm.all_gather_single(empty(world * 10, dtype=torch.float32), torch.zeros(10, device=device()))
        elif kind == "p2p_version":
            if rank == 1:
                wire.WIRE_VERSION = wire.WIRE_VERSION + (1 << 8)
                comm.recv(torch.zeros(10, device=device()), 0)
            else:
                comm.send(torch.zeros(10, device=device()), 1)
        elif kind == "p2p_count":
            if rank == 0:
                works = [comm.isend(torch.zeros(10, device=device()), 1), comm.isend(torch.zeros(20, device=device()), 1)]
            else:
                works = [comm.irecv(torch.zeros(10, device=device()), 0)]
            for w in works:
                w.wait()
        elif kind == "mode":
            mixed = pz.Communicator(compress="always" if rank == 0 else "never", timeout=30)
            mixed.all_gather_single(empty(world * 10, dtype=torch.bfloat16), torch.zeros(10, dtype=torch.bfloat16,
                                                                                        device=device()))
        elif kind == "fp8_reduce":
            comm.all_reduce(torch.zeros(10).to(torch.float8_e4m3fn).to(device()))
    except (pz.MismatchError, TypeError) as e:
        return type(e).__name__, str(e)
    raise AssertionError(f"{kind}: no error raised")
