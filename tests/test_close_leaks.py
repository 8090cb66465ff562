"""Communicator.close() gives back what construction took: after
Communicators created, used and closed (50 over gloo, 15 over the fabric
engine, whose construction costs ~0.2-1 s each on 2 cores), a rank holds
the descriptors and threads it held before them: a leak of one per
Communicator shows as 15 or more. The pz backend's groups likewise, on
destroy_process_group and when their construction fails.

The baseline is taken after one warm-up Communicator (or group), so what a
process creates once, lazily, is in it. The allowance past it is zero: on
this tree even the warm-up leaves nothing measurable behind (0 fds, 0
threads, gloo and fabric alike); the one slack is time, up to 3 s for
closed threads to finish exiting."""
import os
import threading
import time

import pytest
import torch

import comm_harness
import portable_zip as pz
from portable_zip import _C
from harness.ranks import ok

N = {"torch": 50, "fabric": 15}
FABRIC = not (not _C.has_fabric or _C.fabric_probe())


def held() -> dict:
    """This process's descriptors (fd -> what it is) and threads (OS tasks, Python names)."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # listdir's own descriptor, closed already
            pass
    return {"fds": fds, "tasks": len(os.listdir("/proc/self/task")),
            "threads": sorted(t.name for t in threading.enumerate())}


def grown(before: dict, settle: float = 3.0) -> str:
    """'' once fds and threads are back to before (a closed thread may take a
    moment to exit), else what is left, at the end of settle seconds."""
    end = time.monotonic() + settle
    while True:
        now = held()
        extra = {fd: what for fd, what in now["fds"].items() if fd not in before["fds"]}
        if len(now["fds"]) <= len(before["fds"]) and now["tasks"] <= before["tasks"]:
            return ""
        if time.monotonic() > end:
            return (f"{len(now['fds']) - len(before['fds'])} more fds {sorted(extra.values())[:12]}, "
                    f"{now['tasks'] - before['tasks']} more OS threads; Python threads before {before['threads']}, "
                    f"after {now['threads']}")
        time.sleep(0.05)


def churn(rank, world, transport, n):
    """A warm-up Communicator first: what a process creates once, lazily, on
    the first one (gloo's and libfabric's loaded state, torch's pools, the
    calibration cache) is in the baseline; every one after must leave nothing."""
    def one(compress):
        c = pz.Communicator(compress=compress, transport=transport, timeout=30)
        t = torch.full((2048,), float(rank + 1))
        c.all_reduce(t)
        w = c.isend(t, 1 - rank) if rank == 0 else c.irecv(t, 1 - rank)
        w.wait()
        c.close()
        return t

    one("auto")
    before = held()
    for i in range(n):
        t = one(("always", "auto")[i % 2])
    assert torch.equal(t, torch.full((2048,), float(sum(range(1, world + 1))))), t[:4]
    return grown(before)


@pytest.mark.parametrize("transport", ["torch", pytest.param("fabric", marks=pytest.mark.skipif(
    not FABRIC, reason=f"no fabric transport here: {_C.fabric_probe()}"))])
def test_closed_communicators_leave_nothing(transport):
    env = {"PZ_FABRIC_PROVIDER": "tcp;ofi_rxm"} if transport == "fabric" else None
    res = ok(comm_harness.run(2, churn, transport, N[transport], env=env, deadline=120))
    assert res == {0: "", 1: ""}, res


def backend_churn(rank, world, n):
    """The pz backend: groups made, used (a collective and a compressed
    send) and destroyed, and groups whose ranks disagree on the options
    (construction fails on every rank), leave nothing either."""
    import torch.distributed as dist
    from portable_zip.c10d import Options

    def one():
        g = dist.new_group(backend="pz", pg_options=Options(compress="always", timeout=30))
        t = torch.full((2048,), float(rank + 1))
        dist.all_reduce(t, group=g)
        (dist.send if rank == 0 else dist.recv)(torch.ones(1 << 15), 1 - rank, group=g)
        dist.destroy_process_group(g)
        return t

    one()
    before = held()
    for _ in range(n):
        t = one()
    assert torch.equal(t, torch.full((2048,), float(sum(range(1, world + 1))))), t[:4]
    errors = []
    for _ in range(3):
        try:
            dist.new_group(backend="pz", pg_options=Options(compress=("always", "never")[rank], timeout=30))
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            errors.append(type(e).__name__)
    return errors, grown(before)


def test_destroyed_and_failed_pz_groups_leave_nothing():
    res = ok(comm_harness.run(2, backend_churn, 15, deadline=120))
    assert res == {0: (["MismatchError"] * 3, ""), 1: (["MismatchError"] * 3, "")}, res
