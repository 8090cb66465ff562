"""Per-rank bodies of the communicator tests (importable by spawned processes)."""
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import portable_zip as pz
from conftest import same_bits as same
from harness.ranks import device

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
REDUCIBLE = [torch.bfloat16, torch.float16, torch.float32]


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


def moving_ops(comm, rank, world, seed, case, numel, dtype, mode, splits) -> int:
    """Ring send/recv, broadcast, all_gather and an uneven all_to_all over rows
    of 3 elements (splits[i][j]: rows rank i sends rank j), each checked bit
    for bit against the data every rank can rebuild; returns the 4 checks."""
    # Ring send/recv, posted async so no rank blocks the ring.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = empty(numel, dtype=dtype)
    w1 = comm.isend(data(seed, rank, case, numel, dtype), nxt)
    w2 = comm.irecv(got, prv)
    w1.wait(), w2.wait()
    check(same(got, data(seed, prv, case, numel, dtype)), f"send/recv {mode} {dtype} {numel}")
    src = case % world
    t = data(seed, src, case, numel, dtype) if rank == src else empty(numel, dtype=dtype)
    comm.broadcast(t, src)
    check(same(t, data(seed, src, case, numel, dtype)), f"broadcast {mode} {dtype} {numel}")
    out = empty(world * numel, dtype=dtype)
    comm.all_gather_single(out, data(seed, rank, case, numel, dtype))
    want = torch.cat([data(seed, r, case, numel, dtype) for r in range(world)])
    check(same(out, want), f"all_gather {mode} {dtype} {numel}")
    inp = data(seed, rank, case, sum(splits[rank]) * 3, dtype).reshape(-1, 3)
    out = empty(sum(splits[j][rank] for j in range(world)), 3, dtype=dtype)
    comm.all_to_all_single(out, inp, [splits[j][rank] for j in range(world)], splits[rank])
    want = torch.cat([data(seed, j, case, sum(splits[j]) * 3, dtype).reshape(-1, 3)
                      [sum(splits[j][:rank]): sum(splits[j][:rank + 1])] for j in range(world)])
    check(same(out, want), f"all_to_all {mode} {dtype} {numel}")
    return 4


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
                splits = [[(i + j + case) % 4 * (numel % 7 + 1) for j in range(world)] for i in range(world)]
                passed += moving_ops(comm, rank, world, seed, case, numel, dtype, mode, splits)
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
    os.environ["PZ_WAVE_BYTES"] = str(wave_bytes)  # read by the Communicators made below
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
        good = codec.compress  # what the point-to-point path compresses with

        def garbled(t, *args, **kwargs):
            buf = good(t, *args, **kwargs)
            buf[4] = 99  # the header's format version byte
            return buf

        codec.compress = garbled
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
    import portable_zip.comm.agree as agree

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
                agree.WIRE_VERSION = agree.WIRE_VERSION + (1 << 8)  # a peer on the next format version
            comm.all_gather_single(empty(world * 10, dtype=torch.float32), torch.zeros(10, device=device()))
        elif kind == "p2p_version":
            if rank == 1:
                agree.WIRE_VERSION = agree.WIRE_VERSION + (1 << 8)
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


# --- issue 9: plan agreement, bounded waits, argument errors ---------------------------------

def slow_link_auto(timeout=60.0):
    """auto on a link modelled at 0.5 GB/s with a fast codec: small tensors go
    native, large ones compressed, so plans differ by size within one program."""
    return pz.Communicator(compress="auto", timeout=timeout, link_gbps=0.5, latency_us=50, codec_gbps=50)


def batch_plans(rank, world, seed):
    """Defect 1: a rank's group mixes a small and a large tensor to different
    peers; each pair's plan must follow from that pair's tensors alone. Then
    every rank sends a different size to every peer (all pairs, both ways)."""
    comm = slow_link_auto()
    small, big = 1024, 4 << 20
    if rank == 0:
        works = [comm.isend(data(seed, 0, 1, small, torch.bfloat16), 1),
                 comm.isend(data(seed, 0, 2, big, torch.bfloat16), 2)]
        for w in works:
            w.wait()
    elif rank in (1, 2):
        n = small if rank == 1 else big
        got = empty(n, dtype=torch.bfloat16)
        comm.recv(got, 0)
        check(same(got, data(seed, 0, rank, n, torch.bfloat16)), f"rank {rank} got wrong bytes from rank 0")
    # All pairs: rank i sends sizes[i][j] elements to rank j (0, tiny, or large), in one group.
    rng = np.random.default_rng([seed, 5])
    sizes = rng.choice([0, 7, 3000, 1 << 20, (1 << 20) + 5], size=(world, world))
    dtypes = [DTYPES[int(k)] for k in rng.integers(0, len(DTYPES), size=world * world)]
    works, got = [], {}
    for j in range(world):
        if j == rank:
            continue
        dt_out, dt_in = dtypes[rank * world + j], dtypes[j * world + rank]
        works.append(comm.isend(data(seed, rank, 100 + j, int(sizes[rank][j]), dt_out), j))
        got[j] = empty(int(sizes[j][rank]), dtype=dt_in)
        works.append(comm.irecv(got[j], j))
    for w in works:
        w.wait()
    for j, g in got.items():
        check(same(g, data(seed, j, 100 + rank, int(sizes[j][rank]), dtypes[j * world + rank])),
              f"rank {rank}: bytes from rank {j} differ")
    return dict(comm.stats["send"]["plans"]) if "send" in comm.stats else {}


def learned_ratio(rank, world, seed):
    """Defect 2: a compressed broadcast that goes out in pieces, then
    collectives of the same size: every rank must learn the same ratio."""
    os.environ["PZ_PIECE_BYTES"] = "65536"  # many pieces
    comm = pz.Communicator(compress="auto", timeout=60, link_gbps=0.1, latency_us=50, codec_gbps=50)
    n = 1 << 20
    for case in range(3):
        src = case % world
        t = data(seed, src, case, n, torch.bfloat16) if rank == src else empty(n, dtype=torch.bfloat16)
        comm.broadcast(t, src)
        check(same(t, data(seed, src, case, n, torch.bfloat16)), "broadcast")
        out = empty(world * n, dtype=torch.bfloat16)
        comm.all_gather_single(out, data(seed, rank, 10 + case, n, torch.bfloat16))
        check(same(out, torch.cat([data(seed, r, 10 + case, n, torch.bfloat16) for r in range(world)])), "all_gather")
    ratio = comm.policy.ratio[torch.bfloat16]
    everyone = [None] * world
    dist.all_gather_object(everyone, ratio)
    check(len(set(everyone)) == 1, f"ranks learned different ratios: {everyone}")
    if world == 2:  # beyond 2 ranks the model sends a broadcast native (the source's link carries it w-1 times)
        check(comm.stats["broadcast"]["plans"].get("compressed"), f"broadcast never compressed: {comm.stats}")
    return ratio


def split_mismatch(rank, world):
    """Defect 4: an all_to_all whose splits disagree between one pair raises
    MismatchError on every rank (not only the receiver), and the
    communicator still works afterwards."""
    comm = pz.Communicator(compress="always", timeout=20)
    splits_in = [2] * world
    splits_out = [2] * world
    if rank == world - 1:
        splits_in = [3] + [2] * (world - 2) + [1]  # sends 3 rows to rank 0, which expects 2
    inp = data(1, rank, 0, sum(splits_in), torch.bfloat16).reshape(-1, 1)
    out = empty(sum(splits_out), 1, dtype=torch.bfloat16)
    try:
        comm.all_to_all_single(out, inp, splits_out, splits_in)
        err = None
    except pz.MismatchError as e:
        err = str(e)
    t = data(2, rank, 0, 1000, torch.float32, integer=True)
    ref = t.clone()
    comm.all_reduce(t)
    dist.all_reduce(ref)
    check(same(t, ref), "all_reduce after a split mismatch")
    return err


def inplace_all_to_all(rank, world, seed):
    """Defect 5: all_to_all_single(x, x) in every mode, even and uneven splits."""
    out = {}
    for mode in ("never", "always", "auto"):
        comm = pz.Communicator(compress=mode, timeout=30)
        for numel in (6 * world, 30_000 * world):
            x = data(seed, rank, numel, numel, torch.bfloat16)
            comm.all_to_all_single(x, x)
            want = torch.cat([data(seed, j, numel, numel, torch.bfloat16).chunk(world)[rank] for j in range(world)])
            check(same(x, want), f"in-place all_to_all {mode} {numel}")
        x = data(seed, rank, 7, 40_000, torch.float32)
        g = empty(world * 40_000, dtype=torch.float32)
        g[rank * 40_000:(rank + 1) * 40_000].copy_(x)
        comm.all_gather_single(g, g[rank * 40_000:(rank + 1) * 40_000])  # in place, torch's idiom
        check(same(g, torch.cat([data(seed, j, 7, 40_000, torch.float32) for j in range(world)])),
              f"in-place all_gather {mode}")
        out[mode] = True
    return out


def silent_in(rank, world, what, timeout):
    """Defect 6: a peer that goes silent in a gloo reduce_scatter (whose
    wait ignores its timeout) or during calibration: rank 0 raises PeerTimeout
    within the timeout."""
    from portable_zip.comm import calibration

    silent = timeout + 2.0  # past rank 0's deadline, with a margin; no longer (rank 1 then times out itself)
    if what == "calibration":
        if rank == 1:
            calibration.measure_native = lambda *a, **k: time.sleep(silent)
        t0 = time.monotonic()
        try:
            pz.Communicator(compress="auto", timeout=timeout)
        except pz.PeerTimeout as e:
            return time.monotonic() - t0, str(e)
        if rank == 1:
            return None
        raise AssertionError("calibration with a silent peer returned")
    comm = pz.Communicator(compress="auto", timeout=timeout)
    dist.barrier()
    if rank == 1:
        time.sleep(silent)
        return None
    t0 = time.monotonic()
    try:
        comm.reduce_scatter_single(empty(1000, dtype=torch.float32), empty(world * 1000, dtype=torch.float32))
    except pz.PeerTimeout as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError("reduce_scatter with a silent peer returned")


def argument_errors(rank, world):
    """Defect 7 (Communicator side) and 10: local argument errors are clear and local."""
    found = {}

    def expect(name, exc, fn):
        try:
            fn()
        except exc as e:
            found[name] = f"{type(e).__name__}: {e}"
            return
        raise AssertionError(f"{name}: no {exc.__name__}")

    for bad in (0, -1, float("nan"), float("inf")):
        expect(f"timeout={bad}", ValueError, lambda: pz.Communicator(timeout=bad))
    comm = pz.Communicator(compress="always", timeout=30)
    z = torch.zeros(8, dtype=torch.complex64)
    expect("conj view", ValueError, lambda: comm.all_gather_single(empty(world * 8, dtype=torch.complex64), z.conj()))
    expect("neg view", ValueError, lambda: comm.broadcast(torch._neg_view(torch.zeros(8)), 0))
    x = empty(4 * world, 1, dtype=torch.bfloat16)
    expect("float splits", TypeError, lambda: comm.all_to_all_single(x, x, [4.0] * world, [4.0] * world))
    expect("bool rank", ValueError, lambda: comm.send(torch.zeros(3), True if rank == 0 else False))
    # Work.wait(timeout=0.0) on an op still running: PeerTimeout, then a full wait succeeds.
    peer = 1 - rank if world == 2 else (rank + 1) % world
    if rank == 0:
        w = comm.irecv(empty(10, dtype=torch.float32), 1)
        expect("wait(0.0)", pz.PeerTimeout, lambda: w.wait(timeout=0.0))
        expect("wait(-1)", ValueError, lambda: w.wait(timeout=-1))
        w.wait()
    elif rank == 1:
        time.sleep(1.0)
        comm.send(torch.zeros(10), 0)
    del peer
    comm.close()
    expect("closed all_reduce", RuntimeError, lambda: comm.all_reduce(torch.zeros(4)))
    expect("closed isend", RuntimeError, lambda: comm.isend(torch.zeros(4), 1 if rank == 0 else 0))
    return found


def agreement_battery(rank, world, seed, n_ops):
    """Random collectives and p2p groups on a communicator whose plans change
    with size (PZ_CHECK_PLANS on): every result exact, no divergence."""
    os.environ["PZ_CHECK_PLANS"] = "1"
    comm = slow_link_auto()
    rng = np.random.default_rng([seed, 3])  # the same program on every rank
    sizes = [0, 1, 999, 20_000, 300_000, 1 << 20]
    for i in range(n_ops):
        op = ["broadcast", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "p2p"][int(rng.integers(6))]
        dt = [torch.bfloat16, torch.float16, torch.float32][int(rng.integers(3))]
        n = int(sizes[int(rng.integers(len(sizes)))])
        if op == "broadcast":
            src = int(rng.integers(world))
            t = data(seed, src, i, n, dt) if rank == src else empty(n, dtype=dt)
            comm.broadcast(t, src)
            check(same(t, data(seed, src, i, n, dt)), f"op {i}: broadcast")
        elif op == "all_gather":
            out = empty(world * n, dtype=dt)
            comm.all_gather_single(out, data(seed, rank, i, n, dt))
            check(same(out, torch.cat([data(seed, r, i, n, dt) for r in range(world)])), f"op {i}: all_gather")
        elif op in ("all_reduce", "reduce_scatter"):
            x = data(seed, rank, i, world * n, dt, integer=True)
            ref = x.clone()
            dist.all_reduce(ref)
            if op == "all_reduce":
                comm.all_reduce(x)
                check(same(x, ref), f"op {i}: all_reduce")
            else:
                out = empty(n, dtype=dt)
                comm.reduce_scatter_single(out, x)
                check(same(out, ref[rank * n:(rank + 1) * n]), f"op {i}: reduce_scatter")
        elif op == "all_to_all":
            splits = rng.integers(0, max(n // world, 1) + 1, size=(world, world))
            inp = data(seed, rank, i, int(splits[rank].sum()), dt).reshape(-1, 1)
            out = empty(int(splits[:, rank].sum()), 1, dtype=dt)
            comm.all_to_all_single(out, inp, [int(v) for v in splits[:, rank]], [int(v) for v in splits[rank]])
            want = torch.cat([data(seed, j, i, int(splits[j].sum()), dt)[int(splits[j][:rank].sum()):
                                                                         int(splits[j][:rank + 1].sum())]
                              for j in range(world)])
            check(same(out.reshape(-1), want), f"op {i}: all_to_all")
        else:
            pair_sizes = rng.choice(sizes, size=(world, world))
            works, got = [], {}
            for j in range(world):
                if j != rank:
                    works.append(comm.isend(data(seed, rank, 1000 * i + j, int(pair_sizes[rank][j]), dt), j))
                    got[j] = empty(int(pair_sizes[j][rank]), dtype=dt)
                    works.append(comm.irecv(got[j], j))
            for w in works:
                w.wait()
            for j, g in got.items():
                check(same(g, data(seed, j, 1000 * i + rank, int(pair_sizes[j][rank]), dt)), f"op {i}: p2p from {j}")
    plans = {op: s["plans"] for op, s in comm.stats.items()}
    check(any("compressed" in p for p in plans.values()) and any("native" in p for p in plans.values()),
          f"the battery should mix plans: {plans}")
    return plans


def auto_mismatch(rank, world, kind):
    """Defect 3: under compress="auto" with PZ_CHECK_PLANS=1, programs that
    mismatch in an op auto sends native raise MismatchError on every rank
    (without the check they behave as torch.distributed does: docs/COMM.md)."""
    os.environ["PZ_CHECK_PLANS"] = "1"
    comm = pz.Communicator(compress="auto", timeout=30)
    n = 100 + rank  # every kind below disagrees on size (or dtype) between ranks
    try:
        if kind == "all_reduce":
            comm.all_reduce(torch.zeros(n, dtype=torch.float32, device=device()))
        elif kind == "all_gather":
            comm.all_gather_single(empty(world * n, dtype=torch.bfloat16), empty(n, dtype=torch.bfloat16))
        elif kind == "reduce_scatter":
            comm.reduce_scatter_single(empty(n, dtype=torch.float32), empty(world * n, dtype=torch.float32))
        elif kind == "all_to_all":
            comm.all_to_all_single(empty(world * n, 1, dtype=torch.float16), empty(world * n, 1, dtype=torch.float16))
        elif kind == "dtype":
            dt = torch.bfloat16 if rank == 0 else torch.float16
            comm.all_gather_single(empty(world * 100, dtype=dt), empty(100, dtype=dt))
        elif kind == "recv_larger":
            if rank == 0:
                comm.send(torch.zeros(100, device=device()), 1)
            else:
                comm.recv(torch.zeros(200, device=device()), 0)
    except pz.MismatchError as e:
        # The communicator stays usable: a matched op afterwards is exact.
        t = data(3, rank, 0, 1000, torch.float32, integer=True)
        ref = t.clone()
        comm.all_reduce(t)
        dist.all_reduce(ref)
        check(same(t, ref), "all_reduce after a caught mismatch")
        return type(e).__name__, str(e)
    raise AssertionError(f"{kind}: no MismatchError under PZ_CHECK_PLANS")


def uneven_all_to_all_auto(rank, world, seed):
    """Review finding: uneven splits give each rank different input bytes; the
    auto plan must come from the agreed split matrix, the same on every rank."""
    comm = slow_link_auto()
    rows = [[3 if i == 0 else 600_000 for _ in range(world)] for i in range(world)]  # rank 0 sends little
    inp = data(seed, rank, 0, sum(rows[rank]), torch.bfloat16).reshape(-1, 1)
    out = empty(sum(rows[j][rank] for j in range(world)), 1, dtype=torch.bfloat16)
    comm.all_to_all_single(out, inp, [rows[j][rank] for j in range(world)], rows[rank])
    want = torch.cat([data(seed, j, 0, sum(rows[j]), torch.bfloat16)[sum(rows[j][:rank]): sum(rows[j][:rank + 1])]
                      for j in range(world)])
    check(same(out.reshape(-1), want), "uneven all_to_all under auto")
    return dict(comm.stats["all_to_all"]["plans"])


def async_then_direct(rank, world, seed):
    """Review finding: an async op of ours, then the caller's own collective on
    the same group, then wait(): our ops run on a private group, so neither
    reads the other's bytes."""
    comm = pz.Communicator(compress="always", timeout=30)
    for i in range(20):
        x = data(seed, rank, i, 3000, torch.float32, integer=True)
        y = data(seed, rank, 100 + i, 3000, torch.float32, integer=True)
        want_x = sum(data(seed, r, i, 3000, torch.float32, integer=True) for r in range(world))
        want_y = sum(data(seed, r, 100 + i, 3000, torch.float32, integer=True) for r in range(world))
        w = comm.all_reduce(x, async_op=True)
        dist.all_reduce(y)
        w.wait()
        check(same(x, want_x) and same(y, want_y), f"iteration {i}: sums crossed")
    return True


def cache_divergence(rank, world, seed):
    """Review finding: a calibration cache that differs between ranks (rank 0
    once used another margin) must not be reused: plans stay agreed."""
    pz.Communicator(compress="auto", timeout=30, margin=0.05)
    pz.Communicator(compress="auto", timeout=30, margin=0.9 if rank == 0 else 0.05)
    comm = pz.Communicator(compress="auto", timeout=30, margin=0.05, link_gbps=None)
    n = 1 << 20
    t = data(seed, 0, 0, n, torch.bfloat16) if rank == 0 else empty(n, dtype=torch.bfloat16)
    if rank == 0:
        comm.send(t, 1)
    elif rank == 1:
        comm.recv(t, 0)
        check(same(t, data(seed, 0, 0, n, torch.bfloat16)), "send/recv after a divergent cache")
    return comm.policy.margin


def one_rank(rank, world, seed):
    """A 1-rank group (the GPU machine's NCCL with one GPU): every op in every
    mode returns its input's bytes, on a private group created per Communicator."""
    for mode in ("auto", "always", "never"):
        comm = pz.Communicator(compress=mode, timeout=30)
        check(comm.group is not dist.group.WORLD, "a private group")
        for dtype in DTYPES:
            x = data(seed, 0, 1, 70_001, dtype)
            t = x.clone()
            comm.broadcast(t, 0)
            check(same(t, x), f"{mode} broadcast {dtype}")
            out = empty(70_001, dtype=dtype)
            comm.all_gather_single(out, x)
            check(same(out, x), f"{mode} all_gather {dtype}")
            out = empty(70_001, 1, dtype=dtype)
            comm.all_to_all_single(out, x.reshape(-1, 1))
            check(same(out.reshape(-1), x), f"{mode} all_to_all {dtype}")
            if dtype in REDUCIBLE:
                t = x.clone()
                comm.all_reduce(t)
                check(same(t, x), f"{mode} all_reduce {dtype}")
                out = empty(70_001, dtype=dtype)
                comm.reduce_scatter_single(out, x)
                check(same(out, x), f"{mode} reduce_scatter {dtype}")
        comm.close()
    return True


def rejudged(rank, world, seed):
    """A compressed all_reduce that runs slower than the model predicted (the
    last rank's phase sleeps: its cores busy elsewhere) is re-judged alike on
    every rank: auto moves that size to native, every result exact, and
    PZ_CHECK_PLANS=1 checks that every op's policy state agreed. Returns
    (plans seen in order, every rank's slowdown)."""
    os.environ["PZ_CHECK_PLANS"] = "1"
    comm = pz.Communicator(compress="auto", timeout=60, link_gbps=1, latency_us=50, codec_gbps=50)
    n = 1 << 12
    while comm.policy.choose("all_reduce", torch.bfloat16, 2 * n, world) == "native":
        n *= 2
        check(n < 1 << 26, "auto never compresses an all_reduce under a 1 Gbit/s link")
    n *= 2  # comfortably compressed, but not by 4x
    predicted = comm.policy.predict("all_reduce", torch.bfloat16, 2 * n, world)[1]
    plans = slowed_plans(comm, rank, world, seed, n, 8, 4 * predicted)
    everyone = [None] * world
    dist.all_gather_object(everyone, comm.policy.slowdown)
    comm.close()
    return plans, everyone


def slowed_plans(comm, rank, world, seed, n, cases, seconds, coded=None) -> list:
    """all_reduce_plans while the last rank's all_reduce phase sleeps
    seconds after each op (coded given: only where its pairs compress, or
    only where they do not): its cores busy elsewhere."""
    import portable_zip.comm.collectives as coll

    real = coll.all_reduce

    def slow(tp, t, op, pairs, *args, **kwargs):
        out = real(tp, t, op, pairs, *args, **kwargs)
        if rank == world - 1 and (coded is None or any(pairs(p) for p in range(world) if p != rank) == coded):
            time.sleep(seconds)
        return out
    coll.all_reduce = slow
    try:
        return all_reduce_plans(comm, rank, world, seed, n, cases)
    finally:
        coll.all_reduce = real


def all_reduce_plans(comm, rank, world, seed, n, cases) -> list:
    """cases all_reduces of n fresh bf16 values, each exact; the plan each
    ran, as the stats saw it (each op's note rides in the next swap, and
    three running move a factor)."""
    plans = []
    for case in range(cases):
        t = data(seed, rank, case, n, torch.bfloat16)
        before = dict(comm.stats.get("all_reduce", {}).get("plans", {}))
        comm.all_reduce(t)
        after = comm.stats["all_reduce"]["plans"]
        plans.append(next(p for p in after if after[p] != before.get(p, 0)))
        want = torch.stack([data(seed, r, case, n, torch.bfloat16).float() for r in range(world)]).sum(0)
        check(same(t, want.bfloat16()), f"case {case} ({plans[-1]}): not the exact sum")
    return plans
