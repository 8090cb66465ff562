"""One pz.Communicator used from several threads: a call made while
another thread is inside an op raises the clear 'not thread-safe'
RuntimeError at once (never an interleaved op, which would pair wrongly
with the peers' and end in MismatchError or wrong data); sequential use
from different threads works."""
import threading
import time

import pytest
import torch

import comm_harness
import portable_zip as pz
from portable_zip.comm.errors import MismatchError, PeerTimeout
from harness.ranks import ok

NOT_SAFE = "pz.Communicator is not thread-safe"


def collide(rank, world, compress):
    """Thread A is held inside an all_reduce (at its first transfer) while
    thread B calls a collective, a p2p post and a wait: each raises at once;
    A's op then completes exactly, and B's calls after it work."""
    comm = pz.Communicator(compress=compress, timeout=30)
    inside, tried = threading.Event(), threading.Event()
    post = comm.tp.post

    def held_post(ops):
        if not inside.is_set():
            inside.set()
            tried.wait(20)
        return post(ops)

    comm.tp.post = held_post
    t = torch.full((4096,), float(rank + 1))
    a = threading.Thread(target=comm.all_reduce, args=(t,))
    a.start()
    assert inside.wait(20)
    errors = []
    w = None
    for call in (lambda: comm.broadcast(torch.ones(8), 0), lambda: comm.isend(torch.ones(8), 1 - rank),
                 lambda: comm.all_reduce(torch.ones(8), async_op=True)):
        t0 = time.monotonic()
        try:
            w = call()
            errors.append(("returned", time.monotonic() - t0))
        except RuntimeError as e:
            errors.append((str(e), time.monotonic() - t0))
    tried.set()
    a.join(30)
    comm.tp.post = post
    assert w is None
    # sequential use from this (another) thread: fine
    u = torch.full((100,), float(rank + 1))
    comm.all_reduce(u)
    comm.close()
    return errors, t[0].item(), u[0].item(), bool((t == t[0]).all())


@pytest.mark.parametrize("compress", ["always", "never"])
def test_second_thread_inside_raises_at_once(compress):
    res = ok(comm_harness.run(2, collide, compress, deadline=90))
    for r, (errors, a, b, flat) in res.items():
        assert len(errors) == 3, errors
        for msg, took in errors:
            assert msg.startswith(NOT_SAFE) and "use one Communicator per thread or serialize" in msg, (r, msg)
            assert took < 1.0, (r, took)  # at once: no wait for the op inside
        assert a == 3.0 and b == 3.0 and flat, (r, a, b)


def hammer(rank, world, n):
    """Two threads, n identical all_reduces each, on one Communicator."""
    comm = pz.Communicator(compress="always", timeout=4)
    go = threading.Barrier(2)
    out = {}

    def run(name):
        go.wait()
        got = []
        try:
            for _ in range(n):
                t = torch.ones(2048)
                comm.all_reduce(t)
                got.append(bool((t == world).all()))
            out[name] = ("done", got)
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            out[name] = (type(e).__name__, got, str(e)[:200])

    threads = [threading.Thread(target=run, args=(k,)) for k in "AB"]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return out


def test_two_threads_hammering_raise_or_stay_exact():
    """Every result is exact. A thread stops only with the clear error, or
    with PeerTimeout on a rank whose peer refused an op with it (that
    peer's op never comes); never MismatchError."""
    res = ok(comm_harness.run(2, hammer, 30, deadline=120))
    refused = {r for r, out in res.items() if any(v[0] == "RuntimeError" for v in out.values())}
    for r, out in res.items():
        for name, (kind, got, *msg) in out.items():
            assert all(got), (r, name, got)  # no wrong data, ever
            assert kind not in (MismatchError.__name__,), (r, name, msg)
            if kind == "RuntimeError":
                assert msg[0].startswith(NOT_SAFE), (r, name, msg)
            elif kind == PeerTimeout.__name__:
                assert refused - {r}, (r, name, msg)  # only behind the peer's refusal
            else:
                assert kind == "done", (r, name, kind, msg)
