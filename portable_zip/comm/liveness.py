"""The liveness watch (transport/watch.h): per Communicator, one C++ thread
and one authenticated TCP connection per peer, so a peer that dies (its
connection closes) or goes silent (PZ_HEARTBEAT_TIMEOUT, default 4 s) is
noticed within seconds, whatever the op's timeout. Transports check it in
their waits; the fabric engine is aborted by it (a blocked wait raises at
once). The transport that holds it closes it."""
from __future__ import annotations

import contextlib
import re
import time
from typing import Iterable, List, Sequence

import portable_zip._C as _C
from .settings import Settings
from .deadline import Deadline
from .address import SETTINGS_HINT, Listen
from .errors import PeerError, PeerTimeout
from .store import POLL_S, gave_up, swap_through_store
from .transports.base import Op, Transport

HEARTBEAT_TIMEOUT = 4.0  # PZ_HEARTBEAT_TIMEOUT's default


def _hostport(a: str) -> str:
    host, _, port = a.rpartition(" ")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _explained(err: str, facts: List[dict]) -> str:
    """A failed dial, with why the peer listens where it does."""
    m = re.search(r"connecting to rank (\d+) ", err)
    if not m:
        return err
    f = facts[int(m.group(1))]
    why = f" (rank {m.group(1)} on host {f['host']} listens there, chosen by {f['why']})" if f.get("why") else ""
    return f"{err}{why}: {SETTINGS_HINT}"


# What a transport says when it saw a connection end but cannot tell whose,
# or why (a dead peer and one that closed its Communicator look alike there).
_VAGUE = ("a peer's connection closed", "peer likely dead")


class Liveness:
    """Collective: every rank of group makes one at construction, listening
    at `listen` (address.py: where its peers can reach it)."""

    def __init__(self, group, facts: List[dict], settings: Settings, deadline: Deadline, listen: Listen):
        silence = HEARTBEAT_TIMEOUT if settings.heartbeat_timeout is None else settings.heartbeat_timeout
        lo, hi = settings.port_range or (0, 0)
        self.peers = [p for p in range(group.size) if p != group.rank]
        self._w = _C.LivenessWatch(group.rank, list(group.ranks), group.secret, float(silence), listen.ip, "", lo, hi)
        try:
            addrs = [a.decode() for a in swap_through_store(group, "watch", self._w.address(), deadline,
                                                             "its liveness watch address")]
            # In slices: a peer that cannot reach this rank gives up (groups.give_up), and
            # this rank must hear of it at once rather than wait out the whole timeout.
            while not self._w.connect_for(addrs, min(POLL_S, deadline.left())):
                err = gave_up(group)
                if err is not None:
                    raise err
                if time.monotonic() >= deadline.at:
                    late = ", ".join(f"rank {r} (global {group.ranks[r]}, host {facts[r]['host']})"
                                     for r in self._w.missing())
                    raise PeerTimeout(f"liveness watch: {late} did not connect to this rank at "
                                      f"{_hostport(self._w.address())} (chosen by {listen.why}) within "
                                      f"{deadline.timeout:g} s: a firewall, or an address they cannot reach; "
                                      f"{SETTINGS_HINT}")
        except BaseException as e:
            self._w.close()
            if isinstance(e, PeerError) or not isinstance(e, RuntimeError):
                raise
            raise PeerError(_explained(str(e), facts)) from None

    def dead(self):
        """None, or (group rank, why) of the first failure: a dead peer, or one
        that closed while this rank waited on it."""
        return self._w.dead()

    def departed(self):
        """[(group rank, why)] of peers whose connection closed without a goodbye."""
        return self._w.departed()

    def check(self, name: str) -> None:
        """PeerError naming the peer, once the watch has seen a failure."""
        d = self._w.dead()
        if d is not None:
            raise PeerError(f"{name}: {d[1]}")

    @contextlib.contextmanager
    def waiting_on(self, peers: Iterable[int]):
        """A wait on these peers is open: one that says goodbye meanwhile fails it."""
        peers = list(peers)
        self._w.expect(peers, 1)
        try:
            yield
        finally:
            self._w.expect(peers, -1)

    def explain(self, err: PeerError, name: str) -> PeerError:
        """err where the transport could not say whose connection ended, or
        why: the watch's account instead, once it has one (within its 1 s
        grace for a closed connection), else err as it was."""
        if not any(v in str(err) for v in _VAGUE):
            return err
        end = time.monotonic() + 1.5
        while (d := self._w.dead()) is None and time.monotonic() < end:
            time.sleep(0.02)
        return err if d is None else PeerError(f"{name}: {d[1]} (the transport: {err})")

    def attach(self, engine) -> None:
        """At the first failure the fabric engine is aborted: its wait raises."""
        self._w.attach(engine)

    def close(self) -> None:
        """Goodbye to every peer; the thread joined, every socket closed."""
        self._w.close()


class Watched(Transport):
    """The fabric transport with the watch: the watch aborts its engine at a
    failure (a blocked wait raises at once), each wait tells the watch which
    peers it is open on, and close() closes the watch first (goodbye, thread
    joined), then the engine."""

    def __init__(self, inner: Transport, watch: Liveness):
        self.inner, self.watch = inner, watch
        self.name, self.backend, self.rank, self.world = inner.name, inner.backend, inner.rank, inner.world
        self.device, self.sized, self.costs, self.local = inner.device, inner.sized, inner.costs, inner.local
        watch.attach(inner.engine)

    def __getattr__(self, name):  # the engine, its info
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def ctrl_device(self):
        return self.inner.ctrl_device

    def global_rank(self, r: int) -> int:
        return self.inner.global_rank(r)

    def connect(self, deadline: Deadline) -> None:
        self.inner.connect(deadline)

    def post(self, ops: Sequence[Op]):
        return self.inner.post(ops), sorted({peer for _, _, peer in ops})

    def wait(self, pending, deadline: Deadline):
        posted, peers = pending
        with self.watch.waiting_on(peers):
            try:
                return self.inner.wait(posted, deadline)
            except PeerError as e:
                raise self.watch.explain(e, self.name) from None

    def abort(self, why: str) -> None:
        self.inner.abort(why)

    def close(self) -> None:
        self.inner.drain()  # while the watch still hears goodbyes: a peer that left owes no credits
        self.close_watch()
        self.inner.close(drain=False)
