"""Point to point over a Group (group.py): NCCL on CUDA, RCCL on ROCm
(torch's "nccl" backend), gloo on CPU."""
from __future__ import annotations

import collections
import ctypes
import datetime
import queue
import threading
import time
from typing import List, Sequence

import torch

from ..deadline import Deadline
from ..errors import PeerError, PeerTimeout
from .base import RECV, SEND, Op, Transport, as_bytes

_NCCL_MOVES = frozenset((torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
                         torch.int32, torch.int64))
# What each backend moves as it is (gloo also rejects int16 and fp8).
_MOVES = {"nccl": _NCCL_MOVES, "gloo": _NCCL_MOVES | {torch.bool}}
_NOTHING: frozenset = frozenset()
SLICE_S = 0.25  # a wait checks the liveness watch this often


# The latest gloo collectives' works, held past their wait. gloo's worker
# thread drops its own reference to a finished Work just after it wakes the
# waiter; were ours gone first, that drop would free the op's tensors on the
# worker and retake the GIL, which once Python is exiting ends the thread in
# std::terminate (a Communicator left open, issue 36). Held here, the
# worker's drop is never the last; ours is, at a later append or when the
# transport closes (its works hold its group open), on a thread that holds
# the GIL. The deque itself is never freed (one reference more): what it
# holds at exit is left to the OS, not to finalization.
_HELD: collections.deque = collections.deque(maxlen=4)  # (transport id, works)
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_HELD))


def _hold(owner, works) -> None:
    if not isinstance(works, Posted):  # send/recv works: gloo's worker never holds them
        _HELD.append((id(owner), works))


def _release(owner) -> None:
    kept = [h for h in list(_HELD) if h[0] != id(owner)]
    _HELD.clear()
    _HELD.extend(kept)


class Posted(list):
    """post()'s works, with the peers they involve (a wait on them fails when one of those closes)."""
    peers: Sequence[int] = ()


class _Waiter:
    """One daemon thread that waits gloo's send/recv works, whose wait()
    can run once and not be cut short: the caller waits on it in slices and
    checks the liveness watch between them. After a failure it may stay
    stuck until the op's deadline; a daemon, it never holds up exit."""

    def __init__(self):
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._run, name="pz-gloo-wait", daemon=True).start()

    def _run(self):
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, done, box = job
            del job
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box.append(e)
            # Let go of the job's torch Works before the caller goes on: their destructor
            # retakes the GIL, which ends a daemon thread in std::terminate once Python exits.
            del fn, box
            done.set()

    def submit(self, fn):
        done, box = threading.Event(), []
        self._q.put((fn, done, box))
        return done, box

    def stop(self):
        """The thread ends once the wait it runs (if any) ends."""
        self._q.put(None)


def moved_as_is(backend: str) -> frozenset:
    """The dtypes backend moves as they are (no uint8 view needed)."""
    return _MOVES.get(backend, _NOTHING)


def movable(t: torch.Tensor, backend: str) -> torch.Tensor:
    """t itself where the backend moves its dtype, else its uint8 view: a
    fresh view costs a small collective ~5-15 µs of host time (measured on
    gloo), more than the rest of the native plan's checks."""
    if t.dtype in _MOVES.get(backend, _NOTHING):
        return t if t.dim() == 1 else t.reshape(-1)
    return as_bytes(t)


def failed(name: str, e: RuntimeError, timeout: float) -> Exception:
    """torch.distributed's error as ours: PeerTimeout when it timed out, else PeerError."""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "timed out" in msg.lower() or "timeout" in msg.lower():
        return PeerTimeout(f"{name}: a peer did not answer within {timeout:g} s ({msg})")
    return PeerError(f"{name}: transfer failed, peer likely dead ({msg})")


class TorchDistTransport(Transport):
    """Unsized: the pipeline moves a stream's fixed parts, then its tail.
    Its own native collectives run on `group` (local is itself)."""

    def __init__(self, group):
        self.group = group
        self.backend = group.backend
        self.rank, self.world, self.device = group.rank, group.size, group.device
        self.name = f"torch.distributed/{self.backend}"
        self.local = self
        self._global = group.ranks
        self._gloo = self.backend == "gloo"
        self._others = [p for p in range(self.world) if p != self.rank]
        self._waiters: dict = {}  # per calling thread (point to point waits from several at once)
        self._waiters_lock = threading.Lock()
        self._broken = None  # the first transfer failure a wait saw: nothing is posted after it

    def global_rank(self, r: int) -> int:
        return self._global[r]

    def close(self) -> None:
        self.close_watch()
        with self._waiters_lock:
            waiters, self._waiters = list(self._waiters.values()), {}
        for waiter in waiters:
            waiter.stop()
        _release(self)
        self.group.close()

    def connect(self, deadline: Deadline) -> None:
        """Create the group's NCCL communicator now, with all ranks present:
        NCCL builds it lazily and that set-up blocks the host, so a first send
        to a silent peer could otherwise hang past any timeout."""
        if self.world == 1 or self.backend != "nccl":
            return
        one = torch.zeros(1, dtype=torch.uint8, device=self.device)
        bufs = {p: torch.empty_like(one) for p in range(self.world) if p != self.rank}
        self.wait(self.post([(SEND, one, p) for p in bufs] + [(RECV, b, p) for p, b in bufs.items()]), deadline)

    def post(self, ops: Sequence[Op]) -> List[object]:
        if self._broken is not None:
            # A later op's messages would meet a peer still inside the failed one:
            # gloo aborts the process when a message's size differs from the recv's.
            raise PeerError(str(self._broken))
        ops = [(kind, t, peer) for kind, t, peer in ops if t.numel()]
        if not ops:
            return []
        try:
            # On NCCL every post is a batch (Group.send_recv): a lone
            # isend/irecv runs on the pair's own communicator, and a send
            # posted alone on one side but in a batch on the other (3+ ranks:
            # the other side's wave holds more peers) would never match.
            out = Posted(self.group.send_recv([(kind == SEND, movable(t, self.backend), peer)
                                               for kind, t, peer in ops]))
        except RuntimeError as e:
            raise self._named(PeerError(f"{self.name}: posting {len(ops)} transfers failed: {e}"), self.watch) from e
        out.peers = sorted({peer for _, _, peer in ops})
        return out

    def wait(self, works: List[object], deadline: Deadline) -> None:
        """works: post()'s (its peers known) or a collective's (every peer).
        With a liveness watch, a wait ends within a slice of its failure."""
        try:
            return self._wait_watched(works, deadline)
        except PeerError as e:
            self._broken = self._broken or e
            raise
        finally:
            if self._gloo:
                _hold(self, works)

    def _wait_watched(self, works: List[object], deadline: Deadline) -> None:
        watch = self.watch
        if watch is None or not works:
            return self._wait(works, deadline, None)
        watch.check(self.name)
        with watch.waiting_on(getattr(works, "peers", self._others)):
            if self._gloo and isinstance(works, Posted):
                return self._wait_aside(works, deadline, watch)
            return self._wait(works, deadline, watch)

    def _wait(self, works, deadline: Deadline, watch) -> None:
        for w in works:
            try:
                if self._gloo:
                    self._wait_gloo(w, deadline, watch)
                    continue
                # NCCL: wait() only orders streams, so poll completion for the
                # deadline: spin first (a sleep costs ~60 us, more than a small
                # transfer), then back off; the watch is read every slice.
                spin_until = time.monotonic() + 0.005
                look = spin_until + SLICE_S
                while not w.is_completed():
                    now = time.monotonic()
                    if now > deadline.at:
                        raise PeerTimeout(f"{self.name}: a peer did not answer within {deadline.timeout:g} s")
                    if watch is not None and now > look:
                        look = now + SLICE_S
                        self._check_nccl(watch)
                    if now > spin_until:
                        time.sleep(50e-6)
                w.wait()
            except PeerError:
                raise
            except RuntimeError as e:
                raise self._named(failed(self.name, e, deadline.timeout), watch) from e

    def _wait_gloo(self, w, deadline: Deadline, watch) -> None:
        """A gloo collective's work: its wait(timeout) may be repeated, so wait in slices."""
        if watch is None:
            w.wait(datetime.timedelta(seconds=deadline.left()))
            return
        while True:
            try:
                w.wait(datetime.timedelta(seconds=min(SLICE_S, deadline.left())))
                return
            except RuntimeError:
                if w.is_completed() or time.monotonic() >= deadline.at:
                    raise  # its own failure (or the deadline), not a slice's end
            watch.check(self.name)

    def _wait_aside(self, works, deadline: Deadline, watch) -> None:
        """gloo works whose wait runs once (send/recv) or ignores its timeout
        (reduce_scatter): waited by the waiter thread while this one reads
        the watch (if any) and the deadline."""
        me = threading.get_ident()
        with self._waiters_lock:
            waiter = self._waiters.get(me)
            if waiter is None:
                waiter = self._waiters[me] = _Waiter()
        done, box = waiter.submit(lambda: self._wait(works, deadline, None))
        while not done.wait(SLICE_S):
            if watch is not None:
                watch.check(self.name)
            if time.monotonic() > deadline.at + 1.0:  # the waiter's own wait ends at the deadline
                raise PeerTimeout(f"{self.name}: a peer did not answer within {deadline.timeout:g} s")
        if box:
            raise self._named(box[0], watch)

    def _check_nccl(self, watch) -> None:
        """A failure the watch saw: abort the NCCL communicators (nothing stays stuck on the GPU), then raise."""
        if watch.dead() is None:
            return
        try:
            self.group.pg.abort()
        except RuntimeError:
            pass  # already broken: nothing left to abort
        watch.check(self.name)

    def _named(self, e: BaseException, watch) -> BaseException:
        """A transfer's own failure, re-raised naming the peer where the watch
        sees it go (a killed peer's sockets all close at once: it is quick)."""
        if watch is None or not isinstance(e, PeerError) or isinstance(e, PeerTimeout):
            return e
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            d = watch.dead()
            # Every peer gone, not the lowest rank alone: a killed peer and a survivor that left after it.
            gone = [d] if d is not None else watch.departed()
            if gone:  # the names first: torch's own message runs long
                return PeerError(f"{self.name}: {'; '.join(why for _, why in gone)} ({str(e)[len(self.name) + 2:]})")
            time.sleep(0.01)
        return e

    def wait_detached(self, works: List[object], deadline: Deadline) -> None:
        """wait() for works whose own wait ignores its timeout (gloo's
        reduce_scatter blocks until the peer answers or dies): the waiter
        thread waits, this one gives up after the deadline. The group is
        unusable after a timeout anyway, so the stuck waiter is left to
        torch's own timeout."""
        watch = self.watch
        if not self._gloo:
            return self.wait(works, deadline)
        _hold(self, works)
        try:
            if watch is None:
                return self._wait_aside(works, deadline, None)
            watch.check(self.name)
            with watch.waiting_on(self._others):
                self._wait_aside(works, deadline, watch)
        except PeerError as e:
            self._broken = self._broken or e
            raise
