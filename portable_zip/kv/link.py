"""One transfer at a time to or from one peer over a Communicator's
point-to-point path: each message matches the peer's in posting order per
(source, destination, tag) and every peer progresses on its own, so a
receiving thread per source and a sending thread per destination may wait
at once. The Communicator takes one thread inside an op at a time: posts go
under one lock per Communicator, waits outside it."""
from __future__ import annotations

import threading
import weakref

import torch

_guard = threading.Lock()
_locks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def lock_of(comm) -> threading.Lock:
    """The lock every KV object on comm posts under."""
    with _guard:
        lk = _locks.get(comm)
        if lk is None:
            lk = _locks[comm] = threading.Lock()
        return lk


class Link:
    """Blocking single transfers to or from one peer over comm, on tag (one stream per kind of traffic)."""

    def __init__(self, comm, peer: int, tag: int = 0):
        self.comm, self.peer, self.tag, self._lock = comm, peer, tag, lock_of(comm)

    def send(self, t: torch.Tensor) -> None:
        self._run(self.comm.isend, t)

    def isend(self, t: torch.Tensor):
        """Post a send and return its Work: t must stay unchanged until it is done."""
        with self._lock:
            return self.comm.isend(t, self.peer, tag=self.tag).start()  # its own group, as the receiver's are

    def recv(self, t: torch.Tensor) -> None:
        self._run(self.comm.irecv, t)

    def _run(self, post, t: torch.Tensor) -> None:
        with self._lock:
            w = post(t, self.peer, tag=self.tag)
        w.wait()  # outside the lock: other peers' streams progress meanwhile
