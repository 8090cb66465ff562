"""A peer SIGKILLed around a fabric transfer (2 ranks, tcp;ofi_rxm on
loopback): the survivor must raise PeerError / PeerTimeout, never crash or
hang. Each run is two fresh processes (this file run as a script), so a
crash shows as the survivor's signal; bench/fabric_crash_loop.py runs
hundreds of these, this test a few.

Scenarios: the victim dies before any fabric traffic ("before": the
survivor's first send meets a dead peer), or `delay` seconds into a 256 MiB
all_reduce or send/recv ("mid"), raw or compressed."""
from __future__ import annotations

import inspect
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from harness.ranks import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TCP = {"PZ_FABRIC_PROVIDER": "tcp;ofi_rxm", "OMP_NUM_THREADS": "1"}


def _worker(a: dict, rank: int, base) -> dict:
    """One rank of a job: rank 0 survives (returns its outcome), rank 1 is killed."""
    import torch.distributed as dist

    import portable_zip as pz

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a['port']}", rank=rank, world_size=2)
    comm = pz.Communicator(compress=a["mode"], transport="fabric", timeout=60)  # setup on a loaded host
    t = base.clone()
    if a["when"] != "before":  # connections up, a first op done: the kill lands on a warm engine
        comm.all_reduce(t[: 1 << 16])
    comm.timeout = a["timeout"]  # the killed op's
    dist.barrier()
    if rank == 1:
        if a["when"] == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(a["delay"], os.kill, (os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        op = a["op"] if rank == 0 else {"send": "recv", "recv": "send"}.get(a["op"], a["op"])
        # A kill `delay` into traffic: the op repeats, so on a fast host too
        # it is still moving bytes when the kill lands.
        for _ in range(a.get("reps") or (400 if a["when"] == "mid" else 1)):
            if op == "all_reduce":
                comm.all_reduce(t)
            elif op == "send":
                comm.send(t, 1 - rank)
            else:
                comm.recv(t, 1 - rank)
        out = {"outcome": "completed", "elapsed": time.monotonic() - t0}
    except pz.PeerError as e:
        out = {"outcome": "raised", "kind": type(e).__name__, "elapsed": time.monotonic() - t0, "msg": str(e)[:300]}
    t1 = time.monotonic()
    comm.close()  # after a failure too: teardown must not crash
    out["close_s"] = time.monotonic() - t1
    if rank == 1:
        time.sleep(60)  # the timer ends us
    return out


def _backtrace(core_dir: str) -> str:
    """gdb's every-thread backtrace of the survivor's core, if both exist."""
    cores = [f for f in os.listdir(core_dir) if f.startswith("core")]
    if not cores or not shutil.which("gdb"):
        return ""
    r = subprocess.run(["gdb", "-batch", "-ex", "bt 30", "-ex", "x/8i $pc-20", "-ex", "info registers",
                        "-ex", "info sharedlibrary", "-ex", "thread apply all bt 25", sys.executable,
                        os.path.join(core_dir, cores[0])], capture_output=True, text=True, timeout=300)
    return r.stdout[:30000]


def _fork_rank(a: dict, rank: int, base, core_dir: str, out_fd: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: stderr to a file, the survivor's outcome down the pipe
        os.chdir(core_dir)  # core pattern "core": the dump lands here
        err = os.open(os.path.join(core_dir, f"stderr{rank}"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(err, 2)
        if a.get("cores") and rank == 0:
            resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        out = _worker(a, rank, base)
        if rank == 0:
            os.write(out_fd, json.dumps(out).encode())
    except BaseException as e:  # noqa: BLE001 - reported as the run's failure
        os.write(2, f"{type(e).__name__}: {e}\n".encode())
        os._exit(1)
    if rank == 0:  # the survivor leaves as a program does: Python's finalization, then libc's exit and
        sys.exit(0)  # the libraries' destructors (libfabric's among them) over what the failure left open
    os._exit(0)


def _one_job(a: dict, base) -> dict:
    """Fork both ranks from this (warm) process, wait for the survivor, classify."""
    a = {**a, "port": free_port()}
    core_dir = tempfile.mkdtemp(prefix="pz-kill-")
    rd, wr = os.pipe()
    t0 = time.monotonic()
    pids = [_fork_rank(a, r, base, core_dir, wr) for r in range(2)]
    os.close(wr)
    status, end = None, t0 + a["timeout"] + 60
    while time.monotonic() < end:
        pid, st = os.waitpid(pids[0], os.WNOHANG)
        if pid:
            status = st
            break
        time.sleep(0.02)
    for pid in (pids if status is None else pids[1:]):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with os.fdopen(rd, "rb") as f:
        text = f.read().decode()
    res = {k: a[k] for k in ("op", "mode", "when", "delay")}
    res["wall_s"] = round(time.monotonic() - t0, 2)
    with open(os.path.join(core_dir, "stderr0"), errors="replace") as f:
        err = f.read()[-3000:]
    if status is None:
        res.update(outcome="hung", stderr=err)
    elif os.WIFSIGNALED(status):
        res.update(outcome="crashed", signal=signal.Signals(os.WTERMSIG(status)).name, stderr=err,
                   backtrace=_backtrace(core_dir) if a.get("cores") else "")
    elif not text:
        res.update(outcome="failed", rc=os.WEXITSTATUS(status), stderr=err)
    else:
        res.update(json.loads(text))
    shutil.rmtree(core_dir, ignore_errors=True)
    return res


def serve(mib: int) -> None:
    """The warm parent: torch imported and the data made once, then one job
    per JSON line on stdin, one result line on stdout. Forked ranks start in
    milliseconds instead of an import of torch each."""
    import torch

    import portable_zip  # noqa: F401  (loads the extension; libfabric stays unloaded until a rank uses it)

    torch.set_num_threads(1)  # no OpenMP pool in the parent: its forks use none
    base = torch.empty(mib << 19, dtype=torch.bfloat16).normal_(0, 0.02)  # N(0, 0.02^2): compressible
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(_one_job(json.loads(line), base)), flush=True)


class Runner:
    """A serve() process: run(job) -> the survivor's outcome (raised, with
    kind and elapsed; completed, when the kill came too late; crashed, with
    its signal; hung; failed). env: extra variables (ASan's, a build's path)."""

    def __init__(self, mib: int = 256, env: dict | None = None):
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", str(mib)],
                                  env={**os.environ, **TCP, **(env or {})}, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        if self.p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the kill-run server did not start (rc {self.p.wait()})")

    def run(self, op: str, mode: str, when: str, delay: float = 0.0, timeout: float = 3.0,
            cores: bool = False, reps: int = 0) -> dict:
        """reps: how often the op repeats (0: 400 times for a kill mid-traffic, else once)."""
        job = {"op": op, "mode": mode, "when": when, "delay": delay, "timeout": timeout, "cores": cores, "reps": reps}
        self.p.stdin.write(json.dumps(job) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the kill-run server died (rc {self.p.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def _fabric_here() -> str:
    from portable_zip import _C

    return "" if _C.has_fabric and not _C.fabric_probe() else f"no fabric transport here: {_C.fabric_probe()}"


# (op, mode, when, delay): before any traffic, and early in raw and compressed transfers.
CI_JOBS = [("send", "never", "before", 0.0), ("recv", "never", "mid", 0.05), ("all_reduce", "never", "mid", 0.1),
           ("all_reduce", "always", "mid", 0.3)]


@pytest.mark.skipif(bool(_fabric_here()), reason=_fabric_here())
def test_survivor_raises_when_its_peer_is_killed():
    """Each survivor either finished before the kill or raised PeerError /
    PeerTimeout within the timeout and closed: never a signal, never a hang
    (bench/fabric_crash_loop.py runs hundreds of these)."""
    runner = Runner(mib=32)
    try:
        res = [runner.run(*job, timeout=3.0) for job in CI_JOBS]
    finally:
        runner.close()
    for r in res:
        assert r["outcome"] in ("raised", "completed"), r
        if r["outcome"] == "raised":
            assert r["kind"] in ("PeerError", "PeerTimeout") and r["elapsed"] < 3.0 + 3, r
            assert r["close_s"] < 12, r
    assert sum(r["outcome"] == "raised" for r in res) >= 2, res  # the kills landed


def _stale_rendezvous(rank: int, port: int, wait_s: float) -> None:
    """Rank 1 posts a 8 MiB send (rendezvous requests for its first chunks
    reach rank 0, which has posted nothing: unexpected messages) and dies;
    rank 0 posts the matching receive once its engine has seen the
    connection close. Prints what rank 0's receive did."""
    import torch
    import torch.distributed as dist

    from portable_zip import _C

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    eng = _C.FabricEngine("tcp;ofi_rxm", 2, 2 << 20, 4, False, -1, rank, 2, True, 2000, bytes(range(16)), "")
    store = dist.distributed_c10d._get_default_store()
    store.set(f"addr{rank}", eng.address())
    eng.connect([store.get(f"addr{r}") for r in range(2)])
    buf = torch.ones(8 << 20, dtype=torch.uint8)
    dist.barrier()
    if rank == 1:
        eng.post([(0, 0, buf.data_ptr(), buf.numel(), False)], 0)
        time.sleep(0.5)  # the requests are out
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(wait_s)  # the pumps read the queues meanwhile: rxm processes the peer's shutdown
    try:
        got = eng.wait(eng.post([(1, 1, buf.data_ptr(), buf.numel(), False)], 0), 3.0)
        print("receive: " + ("timed out" if got is None else f"completed {got}"), flush=True)
    except RuntimeError as e:
        print(f"receive: raised {e}", flush=True)
    eng.close()
    print("closed", flush=True)
    os._exit(0)


def stale_rendezvous_run(wait_s: float = 2.0, env: dict | None = None) -> tuple:
    """(rank 0's return code, its output): a signal is a negative code."""
    code = ("import os, signal, sys, time\n" + inspect.getsource(_stale_rendezvous) +
            "_stale_rendezvous(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))\n")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-P", "-c", code, str(r), str(port), str(wait_s)],
                              env={**os.environ, **TCP, **(env or {})}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    return procs[0].returncode, out + err[-2000:]


@pytest.mark.skipif(bool(_fabric_here()), reason=_fabric_here())
def test_receive_matching_a_dead_peers_rendezvous_raises():
    """The crash's own sequence, made deterministic: a receive posted after a
    dead peer's connection closed, matching that peer's queued rendezvous
    request, must fail cleanly (libfabric 1.17's rxm, asked for
    FI_DIRECTED_RECV, read through the closed connection's NULL endpoint)."""
    rc, out = stale_rendezvous_run()
    assert rc == 0 and "receive: " in out and "closed" in out, (rc, out)
    assert "completed" not in out, out


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"] or len(sys.argv) != 3:
        sys.exit("usage: test_fabric_kills.py --serve MIB (bench/fabric_crash_loop.py runs it)")
    serve(int(sys.argv[2]))
