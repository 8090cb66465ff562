"""The liveness watch (transport/watch.h, comm/liveness.py): the handshake
admits only peers that prove the group's secret; a killed peer, a silent one
and one that closed while a wait was open on it are each reported, naming
the rank; an orderly goodbye is no death; a Communicator's close returns the
watch's thread and sockets. Over gloo and the fabric, with the default
timeout (300 s), a survivor raises PeerError naming a SIGSTOPped peer within
seconds (the fabric's killed and exited peers: tests/test_comm_failures.py).
How fast, per transport and case: bench/liveness.py."""
import os
import signal
import socket
import tempfile
import threading
import time

import pytest
import torch

import comm_failure_workers as cfw
from comm_harness import run
from portable_zip import _C

NOTICE_S = 20.0  # loose: the watch notices in ~1-5 s; a loaded CI must not flake


def _pair(silence=1.5, secrets=None, ranks=(0, 1)):
    key = os.urandom(16)
    secrets = secrets or (key, key)
    return [_C.LivenessWatch(r, list(ranks), s, silence, "127.0.0.1", "") for r, s in zip((0, 1), secrets)]


def _connect_all(watches, timeout=5.0):
    """connect() on every watch at once; each one's exception or None."""
    addrs = [w.address() for w in watches]
    errs = [None] * len(watches)

    def go(i):
        try:
            watches[i].connect(addrs, timeout)
        except Exception as e:  # noqa: BLE001 - returned to the test
            errs[i] = e

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(watches))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errs


def _until(fn, limit=NOTICE_S):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.01)
    return fn()


def test_strangers_never_count_and_a_wrong_secret_is_refused():
    a, b = _pair()
    port = int(a.address().split()[1])
    # Strangers at rank 0's listener: garbage, a HELLO claiming rank 1 that never proves it, silence.
    junk = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    junk[0].sendall(b"x" * 20)
    junk[1].sendall((0x31575a50).to_bytes(4, "little") + (1).to_bytes(4, "little") + (0).to_bytes(4, "little") + bytes(8))
    assert _connect_all([a, b]) == [None, None]
    assert a.dead() is None and b.dead() is None
    for s in junk:
        s.close()
    time.sleep(0.3)
    assert a.dead() is None and a.departed() == []  # the strangers' closes are no peer's death
    a.close()
    b.close()
    c, d = _pair(secrets=(os.urandom(16), os.urandom(16)))
    errs = _connect_all([c, d], timeout=1.0)
    assert "does not know the group's secret" in str(errs[1]), errs
    assert "did not connect within 1 s" in str(errs[0]), errs
    c.close()
    d.close()


def test_idle_strangers_cannot_turn_a_peer_away():
    """More silent connections than the listener holds: the oldest go, and the real peer still gets in."""
    a, b = _pair()
    port = int(a.address().split()[1])
    junk = [socket.create_connection(("127.0.0.1", port)) for _ in range(80)]
    try:
        assert _connect_all([a, b]) == [None, None]
        assert a.dead() is None and b.dead() is None
    finally:
        for s in junk:
            s.close()
        a.close()
        b.close()


def test_goodbye_is_no_death_but_fails_a_wait_still_open_on_it():
    a, b = _pair()
    assert _connect_all([a, b]) == [None, None]
    b.close()
    time.sleep(1.5)
    assert a.dead() is None and a.departed() == []
    a.expect([1], 1)  # a wait on rank 1 opens after its goodbye: it fails after the grace
    got = _until(a.dead, 5.0)
    assert got == (1, "rank 1 (global 1) closed its Communicator while this rank still waits on it"), got
    a.close()


def test_bad_interface_is_a_clear_error():
    with pytest.raises(ValueError, match="PZ_FABRIC_IFACE=.no-such-if0.: no such network interface on this host .it has:.*lo"):
        _C.LivenessWatch(0, [0, 1], os.urandom(16), 4.0, "", "no-such-if0")


def _child_watch(key, silence):
    """Rank 1 in a forked child (C++ only, no torch): returns (parent's watch, child pid)."""
    parent = _C.LivenessWatch(0, [5, 9], key, silence, "127.0.0.1", "")
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            w = _C.LivenessWatch(1, [5, 9], key, silence, "127.0.0.1", "")
            os.write(w1, w.address().encode())
            w.connect([os.read(r2, 100).decode(), w.address()], 10.0)
            time.sleep(60)
        finally:
            os._exit(0)
    mine = os.read(r1, 100).decode()
    os.write(w2, parent.address().encode())
    parent.connect([parent.address(), mine], 10.0)
    for fd in (r1, w1, r2, w2):
        os.close(fd)
    return parent, pid


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_silent_peer_is_named(how):
    w, pid = _child_watch(os.urandom(16), 1.0)
    try:
        time.sleep(1.5)  # beats flow: a live peer is never reported
        assert w.dead() is None and w.departed() == []
        w.expect([1], 1)
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        rank, why = _until(w.dead)
        assert rank == 1 and why.startswith("rank 1 (global 9) died: "), why
        assert ("connection closed" if how == "kill" else "silent for") in why, why
        assert time.monotonic() - t0 < NOTICE_S
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        w.close()


def _threads_and_fds():
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def closes_its_watch(rank, world):
    import portable_zip as pz

    comm = pz.Communicator(compress="never", transport="torch", timeout=60)
    t = torch.ones(8)
    comm.all_reduce(t)
    with_watch = _threads_and_fds()
    watch = comm.tp.watch
    comm.close()
    return with_watch, _threads_and_fds(), watch.dead(), comm.tp.watch is None


def test_close_returns_the_watch_thread_and_sockets():
    res = run(2, closes_its_watch, deadline=120)
    for r, (status, value) in res.items():
        assert status == "ok", value
        (t0, f0), (t1, f1), dead, gone = value
        # The watch's thread and its peer socket (the group's own threads and sockets go too).
        assert t1 <= t0 - 1 and f1 <= f0 - 1 and dead is None and gone, value


def late_peer(rank, world):
    """Rank 1 comes late to a native gloo all_reduce, a recv and a send:
    rank 0's waits outlast many of their watch slices and still finish right."""
    import portable_zip as pz

    comm = pz.Communicator(compress="auto", codec_gbps=1e-4, timeout=60)
    out = []
    for step in range(3):
        if rank == 1:
            time.sleep(0.8)
        t = torch.full((1000,), float(rank + 1))
        if step == 0:
            comm.all_reduce(t)
            out.append(t[0].item() == 3.0)
        elif rank == step - 1:
            comm.send(torch.full((1000,), 7.0), 1 - rank)
        else:
            got = torch.empty(1000)
            comm.recv(got, 1 - rank)
            out.append(bool((got == 7.0).all()))
    plans = comm.stats["all_reduce"]["plans"]
    comm.close()
    return out, plans


def test_waits_outlast_their_slices():
    res = run(2, late_peer, deadline=120)
    for r, (status, value) in res.items():
        assert status == "ok", value
        out, plans = value
        assert all(out) and len(out) == 2 and set(plans) == {"native"}, value


def sends_then_leaves(rank, world, delay):
    """Rank 0 sends rank 1 4 MiB (its direction's rail connects), then a small message
    (eager: its send completes when its bytes are on their way), and closes
    at once. Rank 1 receives that message and one from rank 2 in one
    exchange, which rank 2 joins `delay` s after rank 0 has closed, so rank
    1's fabric is making progress when it tears rank 0's connections down
    (asserted: connections_torn), and posts the receive for rank 0's bytes
    after that: what rank 0 sent before its goodbye is still delivered. A
    receive it never answers fails within the watch's grace."""
    import torch.distributed as dist

    import portable_zip as pz

    def data(step, r, dtype, n=4096):
        return torch.randn(n, generator=torch.Generator().manual_seed(100 * step + r)).to(dtype)

    out = []
    for step, (dtype, compress) in enumerate([(torch.float32, "never"), (torch.bfloat16, "always")]):
        comm = pz.Communicator(compress=compress, transport="fabric", timeout=30)
        comm.all_reduce(torch.ones(64))  # connections up
        big = data(step, 9, dtype, (4 << 20) // dtype.itemsize)
        if rank == 0:
            comm.send(big, 1)
            comm.isend(data(step, 0, dtype), 1).wait()
            comm.close()
            dist.send(torch.ones(1), 2)  # rank 0 has left: rank 2 may go on
            continue
        if rank == 2:
            dist.recv(torch.ones(1), 0)
            time.sleep(delay)
            comm.send(data(step, 2, dtype), 1)
        else:
            got = torch.empty_like(big)
            comm.recv(got, 0)
            out.append(torch.equal(got.view(torch.uint8), big.view(torch.uint8)))
            # One exchange: its control round with rank 2 holds it open while
            # rank 0 sends (eager: before this rank posts the receive for
            # those bytes) and closes.
            got = {src: torch.empty(4096, dtype=dtype) for src in (0, 2)}
            works = [comm.irecv(got[src], src) for src in (0, 2)]
            for w in works:
                w.wait()
            out.append(int(comm.tp.engine.info()["connections_torn"]) >= 1)  # the tears came while it was open
            for src in (0, 2):
                out.append(torch.equal(got[src].view(torch.uint8), data(step, src, dtype).view(torch.uint8)))
        comm.close()
    comm = pz.Communicator(compress="never", transport="fabric", timeout=30)
    comm.all_reduce(torch.ones(8))
    if rank == 1:  # one more receive from rank 0, which has gone: a clear error within seconds
        time.sleep(delay)
        t0 = time.monotonic()
        try:
            comm.recv(torch.empty(8), 0)
            out.append("no error")
        except pz.PeerError as e:
            out.append(("closed its Communicator" in str(e), time.monotonic() - t0 < NOTICE_S))
    comm.close()
    return out


@pytest.mark.skipif(not _C.has_fabric or bool(_C.fabric_probe()), reason="no fabric transport here")
def test_what_a_peer_sent_before_it_closed_is_delivered():
    # Plan checking off: its extra round makes every exchange wait for all its
    # peers up front, so rank 2 (which joins after rank 0 has left) would hold
    # rank 0's send open and rank 0 could never leave first.
    res = run(3, sends_then_leaves, 1.5, env={"PZ_FABRIC_PROVIDER": "tcp;ofi_rxm", "PZ_CHECK_PLANS": "0"},
              deadline=240)
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, "\n".join(f"rank {r}: {s}: {v}" for r, (s, v) in sorted(res.items()))
    assert res[1][1] == [True] * 8 + [(True, True)], res[1][1]


def quiet_then_killed(rank, world, delay):
    """Rank 2 closes quietly (its goodbye explains the tears of its
    connections); `delay` s later rank 0 is SIGKILLed in the middle of 64 MiB
    sends to rank 1. Rank 1 must raise within seconds, never crash or hang:
    a quiet goodbye's credit must not hide the dead peer's tear."""
    import portable_zip as pz

    comm = pz.Communicator(compress="never", transport="fabric", timeout=20)
    comm.all_reduce(torch.ones(4 << 20))  # 16 MiB: pieces past one chunk, so both rails connect between every pair
    if rank == 2:
        comm.close()
        return "closed"
    big = torch.zeros(16 << 20)
    if rank == 0:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        for _ in range(400):
            comm.send(big, 1) if rank == 0 else comm.recv(big, 0)
        out = "completed"
    except pz.PeerError as e:
        out = ("raised", time.monotonic() - t0 < NOTICE_S, str(e)[:200])
    comm.close()
    return out


@pytest.mark.skipif(not _C.has_fabric or bool(_C.fabric_probe()), reason="no fabric transport here")
def test_a_death_after_a_quiet_goodbye_still_fails_the_survivor():
    res = run(3, quiet_then_killed, 0.5, env={"PZ_FABRIC_PROVIDER": "tcp;ofi_rxm"}, deadline=120)
    assert res[2] == ("ok", "closed"), res[2]
    assert res[0][0] == "hung", res[0]  # killed: it never reports
    status, out = res[1]
    assert status == "ok" and out[:2] == ("raised", True), res[1]


@pytest.mark.parametrize("transport,case", [("torch", "stop"), ("fabric", "stop"), ("torch", "kill")])
def test_peer_named_within_seconds_under_the_default_timeout(transport, case):
    """A SIGSTOPped peer (gloo cannot see it), and over gloo a killed one
    (gloo sees it first; the watch names it)."""
    from portable_zip.comm.transports import fabric

    if transport == "fabric" and fabric.unavailable():
        pytest.skip(f"no fabric transport: {fabric.unavailable()}")
    with tempfile.TemporaryDirectory() as d:
        res = run(2, cfw.liveness_rank, transport, case, os.path.join(d, "left"), deadline=120)
    status, value = res[0]
    assert status == "ok" and value["outcome"] == "raised", res
    want = "silent for" if case == "stop" else "its connection closed"
    assert value["peer_error"] and f"rank 1 (global 1) died: {want}" in value["msg"], value
    assert value["noticed"] < NOTICE_S, value
    assert res[1][0] != "ok", res


@pytest.mark.gpu
@pytest.mark.parametrize("case", cfw.LEAVE_CASES)
def test_nccl_dead_peer_raises_within_seconds(case):
    """NCCL on two GPUs, default timeout: the watch aborts the NCCL group and
    the survivor raises, naming the peer. PZ_SYNC_NATIVE=1: a native plan on
    NCCL is otherwise stream-ordered, with no host wait to raise in."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with tempfile.TemporaryDirectory() as d:
        res = run(2, cfw.liveness_rank, "torch", case, os.path.join(d, "left"), backend="nccl", deadline=180,
                  env={"PZ_SYNC_NATIVE": "1"})
    status, value = res[0]
    assert status == "ok" and value["outcome"] == "raised", res
    assert value["peer_error"] and "rank 1 (global 1)" in value["msg"], value
    assert value["noticed"] < NOTICE_S, value
