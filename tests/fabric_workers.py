"""Per-rank bodies of the fabric-transport tests: every op over libfabric
(tcp;ofi_rxm on loopback), bit-exact against gloo, mixed domains, staging,
and failures."""
import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist

import portable_zip as pz
from comm_workers import DTYPES, REDUCIBLE, check, data, device, empty, moving_ops, slowed_plans
from conftest import same_bits as same


def fabric_battery(rank, world, seed, sizes, domains=None, modes=("always", "never", "auto"), transport="fabric"):
    """Every op and dtype over the fabric (domains=None: every pair; else mixed
    domains, native gloo inside), checked against what gloo computes on the
    same job: moving ops byte for byte; reductions against a gloo
    Communicator running the same algorithm (flat), or, across domains,
    against torch's all_reduce on integer-valued data, and equal on every rank."""
    fab = {m: pz.Communicator(compress=m, transport=transport, timeout=60, domains=domains, device=device())
           for m in modes}
    ref = pz.Communicator(compress="never", transport="torch", timeout=60)
    hier = domains is not None and len({len(d) for d in domains}) == 1 and len(domains[0]) > 1
    passed, case = 0, 0
    for dtype in DTYPES:
        for numel in sizes:
            case += 1
            for mode, comm in fab.items():
                splits = [[(i + 2 * j + case) % 5 * (numel % 7 + 1) for j in range(world)] for i in range(world)]
                passed += moving_ops(comm, rank, world, seed, case, numel, dtype, mode, splits)
                if dtype not in REDUCIBLE:
                    continue
                for op in pz.ReduceOp:
                    mine = data(seed, rank, case, numel, dtype)
                    t = mine.clone()
                    comm.all_reduce(t, op=op)
                    if hier:
                        everyone = torch.empty(world * numel, dtype=dtype)
                        dist.all_gather_into_tensor(everyone, t.cpu())
                        check(all(same(c, t) for c in everyone.chunk(world)), f"all_reduce {op} {mode}: ranks differ")
                        exact = torch.stack([data(seed, r, case, numel, dtype).double() for r in range(world)])
                        exact = {pz.ReduceOp.SUM: exact.sum(0), pz.ReduceOp.AVG: exact.mean(0),
                                 pz.ReduceOp.MIN: exact.min(0).values, pz.ReduceOp.MAX: exact.max(0).values}[op]
                        tol = 0 if op in (pz.ReduceOp.MIN, pz.ReduceOp.MAX) else 0.02 * world
                        check(numel == 0 or (t.cpu().double() - exact.cpu()).abs().max().item() <= tol,
                              f"all_reduce {op} {mode} {dtype}: far from the exact result")
                    else:
                        theirs = mine.to("cpu", copy=True)  # gloo's side of the job moves CPU tensors
                        ref.all_reduce(theirs, op=op)
                        check(same(t.cpu(), theirs), f"all_reduce {op} {mode} {dtype} {numel} differs from gloo's")
                    o1, o2 = empty(numel, dtype=dtype), empty(numel, dtype=dtype)
                    big = data(seed, rank, case + 1000, world * numel, dtype)
                    comm.reduce_scatter_single(o1, big, op=op)
                    o2 = o2.cpu()
                    ref.reduce_scatter_single(o2, big.cpu(), op=op)
                    check(same(o1.cpu(), o2) or hier, f"reduce_scatter {op} {mode} {dtype} {numel} differs from gloo's")
                    passed += 2
    # Integer-valued data: exact in any order, so every plan must equal torch's own all_reduce.
    for op in (pz.ReduceOp.SUM, pz.ReduceOp.MAX):
        case += 1
        mine = data(seed, rank, case, 30_011, torch.bfloat16, integer=True)
        for comm in fab.values():
            ours, theirs = mine.clone(), mine.to("cpu", copy=True)
            comm.all_reduce(ours, op=op)
            dist.all_reduce(theirs, op=op.native())
            check(same(ours.cpu(), theirs), f"integer all_reduce {op} differs from torch.distributed (gloo)")
            passed += 1
    for comm in fab.values():
        comm.close()
    return passed, fab["never"].backend if "never" in fab else ""


def bits(seed, rank, case, numel, dtype):
    """Random bit patterns (NaN payloads, every fp8 code) that any rank can rebuild."""
    rng = np.random.default_rng([seed, rank, case])
    n = numel * torch.empty(0, dtype=dtype).element_size()
    if n == 0:  # numpy's empty arrays carry stride 0, which view() rejects
        return torch.empty(0, dtype=dtype, device=device())
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)).view(dtype).to(device())


def staged_edges(rank, world, seed):
    """The staging ring at its edges (run with PZ_FABRIC_STAGE=1 and a 64 KiB
    chunk): empty, one byte, a chunk exactly, a chunk plus and minus one, many
    chunks, odd sizes; raw and coded; batches of several tensors per peer."""
    chunk = int(os.environ["PZ_FABRIC_CHUNK"])
    comms = {m: pz.Communicator(compress=m, transport="fabric", timeout=60, device=device())
             for m in ("always", "never")}
    sizes = [0, 1, 3, chunk - 1, chunk, chunk + 1, 2 * chunk, 7 * chunk + 5, 1_000_003]
    passed = 0
    for mode, comm in comms.items():
        for i, nbytes in enumerate(sizes):
            for dtype in (torch.uint8, torch.bfloat16, torch.float8_e5m2):
                numel = max(nbytes // torch.empty(0, dtype=dtype).element_size(), 0)
                case = 100 * i + DTYPES.index(dtype) if dtype in DTYPES else 100 * i + 50
                # Every rank sends a different tensor to every peer, several per peer.
                works, want = [], []
                for p in range(world):
                    if p == rank:
                        continue
                    for k in range(2):
                        works.append(comm.isend(bits(seed, rank, case * 16 + p * 4 + k, numel + k, dtype), p))
                    for k in range(2):
                        got = empty(numel + k, dtype=dtype)
                        works.append(comm.irecv(got, p))
                        want.append((got, bits(seed, p, case * 16 + rank * 4 + k, numel + k, dtype)))
                for w in works:
                    w.wait()
                for got, exp in want:
                    check(same(got, exp), f"staged {mode} {dtype} {nbytes}: wrong bytes")
                    passed += 1
    info = comms["never"].tp.info
    for c in comms.values():
        c.close()
    return passed, info


def killed_mid_transfer(rank, world, timeout):
    """The last rank SIGKILLs itself while a large transfer to it is under way;
    every survivor's op raises PeerError within the timeout."""
    comm = pz.Communicator(compress="never", transport="fabric", timeout=timeout)
    dist.barrier()
    victim = world - 1
    big = 64 << 20
    if rank == victim:
        buf = torch.empty(big, dtype=torch.uint8)
        comm.irecv(buf, 0)
        comm._flush()
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        if rank == 0:
            comm.send(torch.ones(big, dtype=torch.uint8), victim)
        comm.all_reduce(torch.ones(1 << 16, dtype=torch.float32))
    except pz.PeerError as e:
        return time.monotonic() - t0, type(e).__name__, str(e)
    raise AssertionError("an op with a killed peer returned")


def construct_error(rank, world):
    """Constructing a fabric Communicator under a bad setting (set in env by the test)."""
    t0 = time.monotonic()
    try:
        pz.Communicator(transport="fabric", timeout=10)
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        return time.monotonic() - t0, type(e).__name__, str(e)
    return time.monotonic() - t0, "none", ""


def settings_mismatch(rank, world):
    os.environ["PZ_FABRIC_RAILS"] = str(1 + rank)
    return construct_error(rank, world)


def domain_errors(rank, world):
    """Bad domains= arguments raise the same clear error on every rank."""
    out = []
    for bad in ([[0]], [[0, 1], [1]], [[0, 5]], "vendor", [[]]):
        try:
            pz.Communicator(transport="fabric", domains=bad, timeout=10)
            out.append("accepted")
        except (TypeError, ValueError) as e:
            out.append(str(e))
    return out


def domains_disagree(rank, world):
    """Ranks passing different domains= raise MismatchError on every rank, at once."""
    mine = [[0, 1], [2]] if rank == 0 else [[0], [1, 2]]
    t0 = time.monotonic()
    try:
        pz.Communicator(transport="fabric", domains=mine, timeout=20)
    except pz.MismatchError as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError("different domains= were accepted")


def fail_mid_exchange(rank, world):
    """An exchange that raises with later waves still posted (a corrupt first
    wave of a broadcast) must cancel them before its buffers are freed: rank 1
    raises, keeps running, and allocates over the freed buffers without a
    crash; its engine is closed after the abort, so its next collective raises."""
    from portable_zip.comm.pipeline import _Exchange

    comm = pz.Communicator(compress="always", transport="fabric", timeout=20)
    n = 30 << 20  # 60 MiB of bf16: four pieces of <= 16 MiB, in waves [0, 1] and [2, 3]
    if rank == 0:
        good, calls = _Exchange._compress, []

        def corrupt_first(self, wave_out):
            new, bufs = good(self, wave_out)
            if not calls:
                bufs[0][30] ^= 0xFF  # the header checksum: the receiver rejects wave 0
            else:
                time.sleep(1.0)  # wave 1 arrives after the receiver gave up
            calls.append(1)
            return new, bufs

        _Exchange._compress = corrupt_first
        try:
            comm.broadcast(data(3, 0, 0, n, torch.bfloat16), 0)
        except Exception:  # noqa: BLE001 - the sender may see the receiver's abort
            pass
        time.sleep(3)
        return "sent"
    t = empty(n, dtype=torch.bfloat16)
    try:
        comm.broadcast(t, 0)
    except pz.PeerError as e:
        msg = str(e)
    else:
        raise AssertionError("a corrupt stream was accepted")
    del t
    junk = [torch.full((n // 3,), 7, dtype=torch.bfloat16) for _ in range(6)]  # reuse the freed memory
    time.sleep(2.5)
    check(all(bool((j == 7).all()) for j in junk), "a cancelled receive wrote into freed memory")
    try:
        comm.broadcast(torch.ones(10), 0)
    except pz.PeerError as e:
        return msg, str(e)
    raise AssertionError("the engine kept running after an aborted exchange")


def sm_budget_everywhere(rank, world, seed):
    """Communicator(max_sms=k) caps every codec launch it makes: blocking
    send/recv on this thread, an async all_reduce and an isend/irecv batch on
    its worker thread. A pz.sm_budget where an op is called caps it too; with
    neither, large tensors use every SM. Returns the codec's own launch report
    (_C.launch_report) per case, after checking every result bit for bit."""
    import contextlib

    from portable_zip import _C

    peer = 1 - rank
    n = 4 << 20  # 8 MiB of bf16 per tensor: free grids span every SM
    mine, theirs = bits(seed, rank, 0, n, torch.bfloat16), bits(seed, peer, 0, n, torch.bfloat16)
    smooth = [data(seed, r, 1, n, torch.bfloat16) for r in range(world)]
    want_sum = (smooth[0].float() + smooth[1].float()).to(torch.bfloat16)
    reports = {}
    for name, cap, budget in (("max_sms=2", 2, None), ("sm_budget(3)", None, 3), ("none", None, None)):
        comm = pz.Communicator(compress="always", transport="fabric", device=device(), max_sms=cap, timeout=120)
        torch.cuda.synchronize()
        _C.launch_report(True)
        with pz.sm_budget(budget) if budget else contextlib.nullcontext():
            got = empty(n, dtype=torch.bfloat16)
            for k in (0, 1):  # blocking, on this thread
                if rank == k:
                    comm.send(mine, peer)
                else:
                    comm.recv(got, peer)
            check(same(got, theirs), f"{name}: send/recv")
            t = smooth[rank].clone()
            comm.all_reduce(t, async_op=True).wait()  # on the worker thread
            check(same(t, want_sum), f"{name}: async all_reduce")
            got2 = empty(n, dtype=torch.bfloat16)
            for w in (comm.isend(mine, peer), comm.irecv(got2, peer)):  # a batch, flushed to the worker
                w.wait()
            check(same(got2, theirs), f"{name}: isend/irecv batch")
        torch.cuda.synchronize()
        reports[name] = _C.launch_report(False)
        comm.close()
    return reports, torch.cuda.get_device_properties(device()).multi_processor_count


def raw_rejudged(rank, world, seed):
    """Over the fabric auto's alternative to compressing is the raw pipeline:
    a raw all_reduce that keeps running slower than the model predicted (the
    last rank's phase sleeps) is re-judged alike on every rank, and that size
    turns compressed; every result exact, PZ_CHECK_PLANS=1 checking every op's
    policy state. Returns (plans seen in order, every rank's raw_slowdown)."""
    os.environ["PZ_CHECK_PLANS"] = "1"
    comm = pz.Communicator(compress="auto", transport="fabric", timeout=60, link_gbps=0.5, latency_us=50,
                           codec_gbps=50)
    pol, n = comm.policy, 1 << 24
    while n > 1 << 19 and pol.choose("all_reduce", torch.bfloat16, 2 * n, world) == "compressed":
        n //= 2  # the largest size auto still sends raw, but by less than 2x
    check(pol.choose("all_reduce", torch.bfloat16, 2 * n, world) == "native" and 2 * n >= pol.RAW_MIN_BYTES,
          f"no raw size of 1 MiB or more below the crossover: {2 * n} bytes")
    native = pol.predict("all_reduce", torch.bfloat16, 2 * n, world)[0]
    check(native >= pol.RAW_MIN_HOST * pol.host_exchange(), f"{2 * n} bytes predicted in {native * 1e3:.2f} ms: "
          f"host work ({pol.host_exchange() * 1e3:.2f} ms an exchange), not the link")
    plans = slowed_plans(comm, rank, world, seed, n, 6, 3 * native, coded=False)
    everyone = [None] * world
    dist.all_gather_object(everyone, (pol.raw_slowdown, pol.slowdown))
    comm.close()
    return plans, everyone


def measured_exchange(rank, world):
    """auto over the fabric measures its host cost per compressed exchange at
    construction: the figure every rank holds is the same, the measuring
    exchange is not in the stats, and the policy starts from a clean slate."""
    comm = pz.Communicator(compress="auto", transport="fabric", timeout=60)
    pol = comm.policy
    host = pol.cal.host_exchange_s
    check(host is not None and host >= 0.0, f"no measured host cost: {host}")
    check(pol.host_exchange() == host and "host per exchange" in pol.cal.describe(), "the model ignores it")
    check(comm.stats == {}, f"the measuring exchange shows in the stats: {comm.stats}")
    check(pol.slowdown == 1.0 and pol.report() == 0, "the measurement left an observation behind")
    # Every pair is on the fabric (no torch collectives): a send is timed one way, not as half a ring exchange.
    check(pol.cal.native["send"] != (pol.cal.alpha, pol.cal.beta), f"send timed as the ring: {pol.cal.native}")
    from portable_zip.comm.policy import PRIOR_RATIO
    check(pol.ratio == PRIOR_RATIO, f"the measuring streams moved the ratio: {pol.ratio}")
    # Collectives' predictions carry the measured figure; point to point keeps the transport's constant.
    import dataclasses
    cal, n = pol.cal, 4 << 20
    before = [pol.predict(op, torch.bfloat16, n, world)[1] for op in ("all_gather", "send")]
    pol.cal = dataclasses.replace(cal, host_exchange_s=host + 1.0)
    after = [pol.predict(op, torch.bfloat16, n, world)[1] for op in ("all_gather", "send")]
    pol.cal = cal
    check(abs(after[0] - before[0] - 1.0) < 1e-9 and after[1] == before[1], f"predictions: {before} -> {after}")
    everyone = [None] * world
    dist.all_gather_object(everyone, (host, pol.fingerprint(torch.bfloat16)))
    check(len(set(everyone)) == 1, f"ranks hold different figures: {everyone}")
    again = pz.Communicator(compress="auto", transport="fabric", timeout=60)  # the cached calibration holds it
    check(again.policy.cal.host_exchange_s == host and again.stats == {}, "the cache lost the measured cost")
    t = data(1, rank, 0, 70_001, torch.bfloat16)
    out = empty(world * t.numel(), dtype=t.dtype)
    comm.all_gather_single(out, t)
    check(all(same(out[r * t.numel():(r + 1) * t.numel()].cpu(), data(1, r, 0, 70_001, torch.bfloat16))
              for r in range(world)), "all_gather after the measurement is wrong")
    again.close()
    comm.close()
    return host
