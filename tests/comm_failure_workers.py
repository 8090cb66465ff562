"""The failure matrix of pz.Communicator: a rank SIGKILLs itself before an op,
right after posting its first control message, or right after posting its
first data wave, and every survivor must raise PeerError (or its subclass
PeerTimeout) within the communicator's timeout + 2 s; no process may be left
behind.

Importing torch costs ~3 s of CPU per process, so one scenario per spawned
process group would not fit CI. Instead one spawned "zygote" process imports
torch and portable_zip once (no torch.distributed, no threads), then forks
every rank of every scenario: each scenario gets fresh processes and a fresh
process group on its own port, a few scenarios run at a time. Each rank is
the leader of its own process group (setpgid), so "the killed rank's children
are gone" is checked as "no process is left in the group of any rank".

Backend-neutral: gloo on CPU (CI); backend="nccl" puts rank r on cuda:r (the
zygote never touches CUDA, so the forks may). On NCCL, run with
PZ_SYNC_NATIVE=1: native plans are otherwise stream-ordered with no host wait,
like torch.distributed's own calls, so a dead peer cannot surface in the op.
"""
from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from harness.ranks import device, free_port

OPS = ["send_recv", "isend_batch", "broadcast", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
STAT_NAME = {"send_recv": "recv", "isend_batch": "recv", "broadcast": "broadcast", "all_reduce": "all_reduce",
             "all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all"}
# mode -> (Communicator kwargs, the plan that mode must run for the matrix's tensors)
MODES = {
    # auto told its codec is far too slow to pay (plain auto on loopback measures
    # the link, and under load has picked compressed for an isend batch).
    "auto-native": ({"compress": "auto", "codec_gbps": 1e-4}, "native"),
    "auto-compressed": ({"compress": "auto", "link_gbps": 0.05, "latency_us": 50, "codec_gbps": 50}, "compressed"),
    "always": ({"compress": "always"}, "compressed"),
    "never": ({"compress": "never"}, "raw"),
}
PHASES = ["before", "control", "data"]
TIMEOUT = 3.0           # the communicator's timeout in the matrix: it bounds the op, not construction
CONSTRUCT_TIMEOUT = 60.0  # construction's bound: a loaded 2-core machine takes seconds to construct
SLACK = 2.0             # survivors must raise within TIMEOUT + SLACK of entering the op
NUMEL = 200_000         # bf16 elements per tensor: auto-compressed picks the compressed plan at this size
SMALL_WAVE = 64 << 10   # PZ_WAVE_BYTES in isend batches: several waves, so a raw batch has a later wave


@dataclass
class Scenario:
    name: str
    world: int
    op: str
    mode: str
    phase: str
    victim: int
    kind: str = "matrix"            # "matrix" | "reinit"
    extra: dict = field(default_factory=dict)


def check_plans():
    """PZ_CHECK_PLANS=1 (the default here) swaps a spec even for native plans:
    then every plan has a control round."""
    return os.environ.get("PZ_CHECK_PLANS", "1") not in ("", "0")


P2P_OPS = ("send_recv", "isend_batch")


def plan_of(mode, op=None):
    """The plan the mode runs for op's tensors. Point to point has no native
    plan: every message travels as a frame and its payload (comm/p2p.py), so
    where auto keeps a collective native it sends p2p raw."""
    plan = MODES[mode][1]
    return "raw" if plan == "native" and op in P2P_OPS else plan


def withholds_sends(op, mode):
    """Where the victim's first data wave is its only one (a raw or native p2p
    transfer, a one-phase raw collective), dying after posting it whole could
    deliver everything: the survivors would rightly finish. There the victim
    dies while posting the wave: its receives go out, its sends do not. A
    compressed wave leaves its coded tails unsent; a raw all_reduce leaves its
    second phase; a raw isend batch its later waves (SMALL_WAVE).
    A native collective is one torch.distributed call whose gloo worker thread
    can deliver the victim's whole part before the SIGKILL lands (seen: the
    survivors of a native all_to_all finished, correctly): there the victim
    dies as it makes the call, after the op's control round."""
    if op == "send_recv":  # a p2p message (frame and payload, raw or compressed) goes in one post
        return True
    plan = plan_of(mode, op)
    if plan == "raw":
        return op not in ("all_reduce", "isend_batch")
    return plan == "native"


def unreachable(world, op, mode, phase):
    """Why a cell cannot exist (the test skips it with this reason), or None."""
    if op == "broadcast" and mode == "auto-compressed" and world > 2:
        return ("auto never picks the compressed plan for broadcast on 3+ ranks: the native tree moves the tensor "
                "once per link, the compressed plan world-1 times at ~0.67 of it")
    if phase == "control" and op in P2P_OPS:
        return ("point to point has no control round: each message's frame travels with its payload in one post "
                "(comm/p2p.py), so 'data' is its first kill point")
    if phase == "control" and plan_of(mode, op) == "native" and not check_plans():
        return "native plans have no control round without PZ_CHECK_PLANS=1"
    return None


def cell_id(world, op, mode, phase):
    return f"w{world}-{op}-{mode}-{phase}"


# --- per-rank data ----------------------------------------------------------------

def tensor(numel, rank, peer=0, index=0, dtype=torch.bfloat16):
    """A small-integer-valued tensor particular to (rank, peer, index): exact
    under SUM over 3 ranks in any dtype used here, and compressible."""
    v = (torch.arange(numel, dtype=torch.int64) * (2 * rank + 3) + 5 * peer + 11 * index) % 29 - 14
    return v.to(dtype).to(device())


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and (
        a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def a2a_splits(world, numel_rows):
    """Uneven splits: rank i sends splits[i][j] rows to rank j (every one > 0)."""
    base = max(numel_rows // (world * world), 1)
    return [[base * (1 + (i + 2 * j) % 3) for j in range(world)] for i in range(world)]


class OpCase:
    """One op of the matrix, with different tensors per rank (and per peer for
    p2p), run by every rank of the group: victim = the rank that will die.
    run(comm) performs the op; check() verifies a successful run bit for bit."""

    def __init__(self, op, rank, world, victim, numel):
        self.op, self.rank, self.world, self.victim, self.numel = op, rank, world, victim, numel
        w, r = world, rank
        dt = torch.bfloat16
        if op == "send_recv":
            # The victim sends a different tensor to each survivor (blocking, in rank order).
            if r == victim:
                self.sends = [(p, tensor(numel, r, p)) for p in range(w) if p != r]
            else:
                self.got = torch.empty(numel, dtype=dt, device=device())
        elif op == "isend_batch":
            # Every rank sends 3 tensors (bf16, fp16, fp8) to every other rank, each different.
            kinds = [torch.bfloat16, torch.float16, torch.float8_e4m3fn]
            self.out = {p: [tensor(numel // 2 + i, r, p, i, kinds[i]) for i in range(3)] for p in range(w) if p != r}
            self.inb = {p: [torch.empty(numel // 2 + i, dtype=kinds[i], device=device()) for i in range(3)]
                        for p in range(w) if p != r}
        elif op == "broadcast":
            self.t = tensor(numel, victim) if r == victim else torch.empty(numel, dtype=dt, device=device())
        elif op == "all_reduce":
            self.t = tensor(numel - numel % w, r)
        elif op == "all_gather":
            self.inp = tensor(numel, r)
            self.out = torch.empty(w * numel, dtype=dt, device=device())
        elif op == "reduce_scatter":
            n = numel - numel % w
            self.inp = tensor(n, r)
            self.out = torch.empty(n // w, dtype=dt, device=device())
        elif op == "all_to_all":
            sp = a2a_splits(w, numel // 4)
            self.in_splits = sp[r]
            self.out_splits = [sp[j][r] for j in range(w)]
            self.inp = tensor(sum(self.in_splits) * 4, r).reshape(-1, 4)
            self.out = torch.empty(sum(self.out_splits), 4, dtype=dt, device=device())
        else:
            raise ValueError(op)

    def run(self, comm):
        op, r = self.op, self.rank
        if op == "send_recv":
            if r == self.victim:
                for p, t in self.sends:
                    comm.send(t, p)
            else:
                comm.recv(self.got, self.victim)
        elif op == "isend_batch":
            works = [comm.isend(t, p) for p, ts in self.out.items() for t in ts]
            works += [comm.irecv(t, p) for p, ts in self.inb.items() for t in ts]
            for wk in works:
                wk.wait()
        elif op == "broadcast":
            comm.broadcast(self.t, self.victim)
        elif op == "all_reduce":
            comm.all_reduce(self.t)
        elif op == "all_gather":
            comm.all_gather_single(self.out, self.inp)
        elif op == "reduce_scatter":
            comm.reduce_scatter_single(self.out, self.inp)
        elif op == "all_to_all":
            comm.all_to_all_single(self.out, self.inp, self.out_splits, self.in_splits)

    def check(self):
        """Bit-exact results of a run where nobody died."""
        op, r, w, n = self.op, self.rank, self.world, self.numel
        if op == "send_recv":
            return r == self.victim or same(self.got, tensor(n, self.victim, r))
        if op == "isend_batch":
            return all(same(t, tensor(t.numel(), p, r, i, t.dtype)) for p, ts in self.inb.items()
                       for i, t in enumerate(ts))
        if op == "broadcast":
            return same(self.t, tensor(n, self.victim))
        if op == "all_reduce":
            m = n - n % w
            want = sum(tensor(m, j).float() for j in range(w)).to(torch.bfloat16)
            return same(self.t, want)
        if op == "all_gather":
            return same(self.out, torch.cat([tensor(n, j) for j in range(w)]))
        if op == "reduce_scatter":
            m = n - n % w
            want = sum(tensor(m, j).float() for j in range(w)).to(torch.bfloat16)
            return same(self.out, want[r * (m // w): (r + 1) * (m // w)])
        if op == "all_to_all":
            sp = a2a_splits(w, n // 4)
            parts = [tensor(sum(sp[j]) * 4, j).reshape(-1, 4)[sum(sp[j][:r]): sum(sp[j][:r + 1])] for j in range(w)]
            return same(self.out, torch.cat(parts))
        raise ValueError(op)


# --- the victim's hooks -----------------------------------------------------------

def die():
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached


def _is_control(tensors):
    """Control messages (point-to-point frames, the collectives' spec swap, a plan
    hash) are int64; the matrix never moves int64 data."""
    return all(t.dtype == torch.int64 for t in tensors)  # a p2p frame posted with its payload is data


def arm(phase, withhold):
    """Make this process die at the phase's point of the next op.

    control: right after the post that carries its first control message.
    data:    right after posting its first data wave (with withhold, the
             wave's receives only; for a native collective, which does not go
             through the transport, at the torch.distributed call)."""
    from portable_zip.comm.group import Group
    from portable_zip.comm.transports.torch import TorchDistTransport

    orig_post = TorchDistTransport.post

    def post(self, ops, *args, **kwargs):
        ops = list(ops)
        tensors = [o[1] for o in ops if o[1].numel()]
        if tensors and _is_control(tensors) and phase == "control":
            orig_post(self, ops, *args, **kwargs)
            die()
        if tensors and not _is_control(tensors) and phase == "data":
            if withhold:
                ops = [o for o in ops if o[0] != "send"]
            orig_post(self, ops, *args, **kwargs)
            die()
        return orig_post(self, ops, *args, **kwargs)

    TorchDistTransport.post = post

    def wrap(fn):
        def native(*args):
            ctrl = _is_control([a for a in args if isinstance(a, torch.Tensor)])
            if (phase == "control" and ctrl) or (phase == "data" and not ctrl):
                if phase == "data" and withhold:
                    die()
                fn(*args)  # posted (every Group op is async): the peers see it start, then this rank dies
                die()
            return fn(*args)
        return native

    for name in ("broadcast", "all_reduce", "all_to_all", "all_gather", "reduce_scatter"):  # torch's own ops
        setattr(Group, name, wrap(getattr(Group, name)))


def _set_wave_bytes(n):
    """PZ_WAVE_BYTES for the Communicators this process makes next (read at construction)."""
    os.environ["PZ_WAVE_BYTES"] = str(n)


# --- rank bodies ------------------------------------------------------------------

def _wait_dead(pid, limit=10.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.01)
    return False


def _make_comm(pz, mode, timeout):
    """Constructed under CONSTRUCT_TIMEOUT; its ops then run under timeout
    (every op reads comm.timeout when it starts)."""
    kwargs, _ = MODES[mode]
    comm = pz.Communicator(timeout=max(timeout, CONSTRUCT_TIMEOUT), **kwargs)
    comm.timeout = timeout
    return comm


# --- a peer that leaves while every survivor waits on it (liveness) ----------------
# exit: the process ends before it sends; kill: SIGKILL mid-transfer (every
# survivor sending it BIG bytes); stop: SIGSTOP (silent, connections open).
LEAVE_CASES = ("exit", "kill", "stop")
BIG = 128 << 20


def leave_and_wait(comm, rank, world, case, stamp):
    """The last rank leaves per case, writing (its pid, the monotonic time it
    leaves: the clock is the host's) to the file stamp first. Each survivor
    returns {outcome, type, peer_error, msg, elapsed (from the op's start),
    noticed (from the victim's leaving)}, or the op's results if it returned."""
    import portable_zip as pz

    victim = world - 1
    dev = torch.device("cuda", torch.cuda.current_device()) if comm.device.type == "cuda" else torch.device("cpu")
    small = torch.empty(1 << 10, dtype=torch.uint8, device=dev)
    if rank == victim:
        if case == "kill":
            bufs = [torch.empty(BIG, dtype=torch.uint8, device=dev) for _ in range(world - 1)]
            works = [comm.irecv(b, p) for p, b in enumerate(bufs)]
            comm._flush()  # posted: the survivors' sends are under way
            time.sleep(0.01)
            del works
        _stamp(stamp)
        if case == "exit":
            os._exit(0)
        os.kill(os.getpid(), signal.SIGSTOP if case == "stop" else signal.SIGKILL)
        time.sleep(600)  # stopped until a survivor kills it
    t0 = time.monotonic()
    try:
        if case == "kill":
            comm.send(torch.ones(BIG, dtype=torch.uint8, device=dev), victim)
        comm.recv(small, victim)
    except pz.PeerError as e:
        t1 = time.monotonic()
        pid, left = _read_stamp(stamp)
        if case == "stop":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # another survivor killed it first
        return {"outcome": "raised", "type": type(e).__name__, "peer_error": True, "elapsed": t1 - t0,
                "noticed": t1 - left, "msg": str(e)[:400]}
    return {"outcome": "returned", "elapsed": time.monotonic() - t0}


def _stamp(path):
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {time.monotonic()!r}")
    os.rename(path + ".tmp", path)


def _read_stamp(path, limit=30.0):
    end = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.01)
    with open(path) as f:
        pid, t = f.read().split()
    return int(pid), float(t)


def liveness_rank(rank, world, transport, case, stamp):
    """For run_ranks (tests/comm_harness.py): a Communicator over the job's
    group with the default timeout, then leave_and_wait."""
    import portable_zip as pz

    comm = pz.Communicator(compress="never", transport=transport)
    dist.barrier()
    return leave_and_wait(comm, rank, world, case, stamp)


def matrix_rank(sc: Scenario, rank: int, world: int, piddir: str):
    """One cell: warm-up (the same op on the same tensors, which must pick the
    mode's plan and be bit-exact), a barrier, then the victim dies at the
    phase's point and each survivor reports how its op ended."""
    import portable_zip as pz

    _set_wave_bytes(SMALL_WAVE)
    comm = _make_comm(pz, sc.mode, TIMEOUT)
    numel = NUMEL
    warm = OpCase(sc.op, rank, world, sc.victim, numel)
    warm.run(comm)
    stat = "send" if sc.op == "send_recv" and rank == sc.victim else STAT_NAME[sc.op]
    plans = comm.stats[stat]["plans"]
    want = plan_of(sc.mode, sc.op)
    if set(plans) != {want}:
        raise AssertionError(f"{sc.name}: warm-up ran plans {plans}, the cell is about the {want} plan")
    if not warm.check():
        raise AssertionError(f"{sc.name}: warm-up result is wrong (rank {rank})")
    case = OpCase(sc.op, rank, world, sc.victim, numel)
    del warm
    dist.barrier()
    if rank == sc.victim:
        if sc.phase == "before":
            die()
        arm(sc.phase, withholds_sends(sc.op, sc.mode))
        case.run(comm)
        return {"outcome": "victim survived: the hook never fired"}
    if sc.phase == "before" and not _wait_dead(_read_pid(piddir, sc.victim)):
        raise AssertionError("the victim did not die")
    t0 = time.monotonic()
    try:
        case.run(comm)
    except pz.PeerError as e:
        return {"outcome": "raised", "type": type(e).__name__, "peer_error": True, "elapsed": time.monotonic() - t0,
                "msg": str(e)[:300]}
    except BaseException as e:  # noqa: BLE001 - any other error is a finding
        return {"outcome": "raised", "type": type(e).__name__, "peer_error": False, "elapsed": time.monotonic() - t0,
                "msg": f"{e}"[:300] + "\n" + traceback.format_exc()[-1500:]}
    return {"outcome": "returned", "elapsed": time.monotonic() - t0, "correct": case.check()}


def fabric_rank(sc: Scenario, rank: int, world: int, piddir: str):
    """A fabric cell: the default timeout (300 s); the victim leaves per
    sc.phase (exit, kill) while every survivor waits on it."""
    import portable_zip as pz

    comm = pz.Communicator(compress="never", transport="fabric")
    dist.barrier()
    return leave_and_wait(comm, rank, world, sc.phase, os.path.join(piddir, "left"))


def reinit_rank(sc: Scenario, rank: int, world: int, piddir: str):
    """A victim dies in an op; the survivors raise, destroy the process group,
    init a fresh 2-rank group on a new port, and a new Communicator in every
    mode runs one op of each kind bit-exact."""
    import portable_zip as pz

    _set_wave_bytes(SMALL_WAVE)
    numel = NUMEL
    comm = _make_comm(pz, sc.mode, TIMEOUT)
    case = OpCase(sc.op, rank, world, sc.victim, numel)
    dist.barrier()
    if rank == sc.victim:
        arm("data", withholds_sends(sc.op, sc.mode))
        case.run(comm)
        return {"outcome": "victim survived: the hook never fired"}
    t0 = time.monotonic()
    try:
        case.run(comm)
        raise AssertionError("the op returned although a peer died in it")
    except pz.PeerError as e:
        failed = {"type": type(e).__name__, "elapsed": time.monotonic() - t0}
    del case, comm
    t1 = time.monotonic()
    dist.destroy_process_group()
    destroy_s = time.monotonic() - t1
    survivors = [r for r in range(world) if r != sc.victim]
    new_rank = survivors.index(rank)
    _init(sc.extra["backend"], sc.extra["port2"], new_rank, len(survivors), pg_timeout=60)
    checked = []
    for mode in MODES:
        comm = _make_comm(pz, mode, 30.0)
        for op in OPS:
            c = OpCase(op, new_rank, 2, 1, 20_001 if op != "isend_batch" else 6_001)
            c.run(comm)
            if not c.check():
                raise AssertionError(f"after re-init: {op} under {mode} is wrong on rank {new_rank}")
            checked.append(f"{mode}/{op}")
    dist.destroy_process_group()
    return {"outcome": "reinit ok", "failed": failed, "destroy_s": destroy_s, "checked": len(checked)}


def _read_pid(piddir, rank):
    with open(os.path.join(piddir, f"{rank}.pid")) as f:
        return int(f.read())


def _init(backend, port, rank, world, pg_timeout):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))


def _child(sc: Scenario, rank: int, port: int, backend: str, piddir: str, resdir: str):
    """A forked rank: its own process group leader; result pickled to a file."""
    try:
        os.setpgid(0, 0)
        with open(os.path.join(piddir, f"{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        _init(backend, port, rank, sc.world, pg_timeout=60)
        body = {"reinit": reinit_rank, "fabric": fabric_rank}.get(sc.kind, matrix_rank)
        out = ("ok", body(sc, rank, sc.world, piddir))
    except BaseException as e:  # noqa: BLE001 - everything goes to the parent
        out = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
    try:
        tmp = os.path.join(resdir, f"{rank}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(out, f)
        os.rename(tmp, os.path.join(resdir, f"{rank}.res"))
    finally:
        os._exit(0)  # skip process-group teardown, which can block when a peer is gone


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _run_one(sc, backend, deadline):
    """Fork the scenario's ranks; returns a handle polled by _finish."""
    base = tempfile.mkdtemp(prefix=f"pzfail-{sc.name}-")
    piddir, resdir = os.path.join(base, "pid"), os.path.join(base, "res")
    os.mkdir(piddir)
    os.mkdir(resdir)
    port = free_port()
    if sc.kind == "reinit":
        sc.extra["port2"] = free_port()
    sc.extra["backend"] = backend
    pids = []
    for r in range(sc.world):
        pid = os.fork()
        if pid == 0:
            _child(sc, r, port, backend, piddir, resdir)
        pids.append(pid)
    return {"sc": sc, "pids": pids, "status": {}, "end": time.monotonic() + deadline, "resdir": resdir,
            "base": base, "t0": time.monotonic()}


def _poll(h):
    """Reap exited ranks; at the deadline kill what is left (its whole group)."""
    for r, pid in enumerate(h["pids"]):
        if r in h["status"]:
            continue
        got, st = os.waitpid(pid, os.WNOHANG)
        if got:
            h["status"][r] = ("signal", os.WTERMSIG(st)) if os.WIFSIGNALED(st) else ("exit", os.WEXITSTATUS(st))
    if len(h["status"]) < len(h["pids"]) and time.monotonic() > h["end"]:
        for r, pid in enumerate(h["pids"]):
            if r not in h["status"]:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                h["status"][r] = ("hung", None)
    return len(h["status"]) == len(h["pids"])


def _finish(h):
    import shutil

    sc = h["sc"]
    ranks = {}
    for r in range(sc.world):
        path = os.path.join(h["resdir"], f"{r}.res")
        if h["status"][r][0] == "hung":
            ranks[r] = ("hung", "")
        elif os.path.exists(path):
            with open(path, "rb") as f:
                ranks[r] = pickle.load(f)
        elif h["status"][r] == ("signal", signal.SIGKILL):
            ranks[r] = ("killed", "")
        else:
            ranks[r] = ("error", f"exited {h['status'][r]} without a result")
    # Every rank's process group (itself and anything it started) must be gone.
    leftover = []
    grace = time.monotonic() + 3.0
    for pid in h["pids"]:
        while _group_alive(pid) and time.monotonic() < grace:
            time.sleep(0.05)
        if _group_alive(pid):
            leftover.append(pid)
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(h["base"], ignore_errors=True)
    return {"ranks": ranks, "leftover": leftover, "wall": time.monotonic() - h["t0"]}


def zygote(scenarios, backend, parallel, deadline, conn):
    """Runs in a spawned process: fork every scenario's ranks, `parallel` scenarios at a time."""
    torch.set_num_threads(1)
    try:
        results, queue, running = {}, list(scenarios), []
        while queue or running:
            while queue and len(running) < parallel:
                running.append(_run_one(queue.pop(0), backend, deadline))
            time.sleep(0.02)
            for h in [h for h in running if _poll(h)]:
                running.remove(h)
                results[h["sc"].name] = _finish(h)
        conn.send(("ok", results))
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    conn.close()


def run_scenarios(scenarios, backend="gloo", parallel=3, deadline=60.0, total_deadline=600.0):
    """{scenario name: {"ranks": {rank: (status, value)}, "leftover": [pids], "wall": s}}."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    env = {"OMP_NUM_THREADS": "1", "PZ_CHECK_PLANS": os.environ.get("PZ_CHECK_PLANS", "1")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=zygote, args=(scenarios, backend, parallel, deadline, child))
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    child.close()
    try:
        if not parent.poll(total_deadline):
            raise TimeoutError(f"the failure-matrix zygote gave no answer in {total_deadline:g} s")
        status, value = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise RuntimeError(value)
    return value


def reinit_scenarios():
    """The victim dies mid-data in a compressed all_reduce, or in a native
    all_gather (gloo's worker thread is then stuck in the collective)."""
    return [Scenario(f"reinit-after-{op}-{mode}", 3, op, mode, "data", 2, kind="reinit")
            for op, mode in (("all_reduce", "always"), ("all_gather", "auto-native"))]


def fabric_scenarios():
    """The fabric under its default timeout: the victim (the last rank) exits
    before sending, or is SIGKILLed mid-transfer."""
    return [Scenario(f"fabric-w{w}-{case}", w, "send_recv", "never", case, w - 1, kind="fabric")
            for w, case in ((3, "exit"), (3, "kill"), (2, "kill"))]


def matrix_scenarios(world, ops=OPS, modes=MODES, phases=PHASES):
    out = []
    for i, op in enumerate(ops):
        for mode in modes:
            for phase in phases:
                if unreachable(world, op, mode, phase):
                    continue  # the test module skips the cell explicitly, with the reason
                victim = (1 + i) % world  # the dying rank moves around the group
                out.append(Scenario(cell_id(world, op, mode, phase), world, op, mode, phase, victim))
    return out


def table(results, scenarios):
    rows = ["| world | op | mode (plan) | phase | survivors: outcome, elapsed |", "|---|---|---|---|---|"]
    for sc in scenarios:
        res = results.get(sc.name)
        if res is None:
            rows.append(f"| {sc.world} | {sc.op} | {sc.mode} | {sc.phase} | not run |")
            continue
        cells = []
        for r, (st, v) in sorted(res["ranks"].items()):
            if r == sc.victim:
                continue
            if st == "ok" and v.get("outcome") == "raised":
                cells.append(f"r{r} {v['type']} {v['elapsed']:.2f}s")
            elif st == "ok":
                cells.append(f"r{r} {v}")
            else:
                cells.append(f"r{r} {st}: {str(v).splitlines()[0][:80] if v else ''}")
        vic = res["ranks"][sc.victim][0]
        lo = f"; LEFTOVER {res['leftover']}" if res["leftover"] else ""
        rows.append(f"| {sc.world} | {sc.op} | {sc.mode} ({plan_of(sc.mode, sc.op)}) | {sc.phase} | "
                    f"{'; '.join(cells)} (victim r{sc.victim}: {vic}){lo} |")
    return "\n".join(rows)


if __name__ == "__main__":
    # python -P tests/comm_failure_workers.py [--nccl] [--only=OP,...] [world ...]: run the matrix, print the table.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import comm_failure_workers as cfw  # the importable copy, for the spawned zygote

    # --only=OP,... keeps the cells of those ops (a bounded run on the GPU machine).
    nccl = "--nccl" in sys.argv
    only = [a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--only=")]
    worlds = [int(w) for w in sys.argv[1:] if not w.startswith("--")] or ([2] if nccl else [3, 2])
    scs = [s for w in worlds for s in cfw.matrix_scenarios(w)] + ([] if nccl else cfw.reinit_scenarios())
    if only:
        scs = [s for s in scs if any(f"-{op}-" in s.name for op in only[0])]
    t = time.monotonic()
    res = cfw.run_scenarios(scs, backend="nccl" if nccl else "gloo", parallel=1 if nccl else 3)
    print(cfw.table(res, [s for s in scs if s.kind == "matrix"]))
    for s in scs:
        if s.kind == "reinit":
            print(s.name, {r: v for r, v in res[s.name]["ranks"].items()})
    print(f"{len(scs)} scenarios in {time.monotonic() - t:.1f} s")
