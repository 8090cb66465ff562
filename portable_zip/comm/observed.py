"""What a sender has seen of each peer's link. A point-to-point plan is the
sender's alone (the receiver reads it from the frame), so the sender may
judge it by its own observations, with no agreement round.

A raw message's arrival time at the receiver (its ACK carries it) over the
calibrated prediction is one observation of that pair's link: the
receiver's figure, since the sender's send completes once the bytes are in
its socket buffers, long before they arrive. It runs slower than calibrated when the
link is shared (one prefill rank sending to three decode ranks through one
NIC) or busier than it was at construction. Under auto, a pair whose raw
messages keep running slower than predicted is judged with its link that
much slower, for raw and compressed alike. Each compressed message to that
peer moves the factor a step back toward 1, so a link that frees up is
tried raw again, and re-measured.

A compressed message's whole time less any wait for the receiver (the
sender's lead to its first post, then the receiver's own time from reading
that first frame to landing the message, which its ACK carries) over the
compressed prediction is one observation of how the model misjudges
compressing to that peer (CodedSeen): staging where the fabric has no GPU
memory registration, a codec sharing the GPU, read-backs the constants
leave out. A receive posted late, a message staged, the ACK's way back and
the peer's own traffic are not in it."""
from __future__ import annotations

import statistics
import threading
from typing import Callable, Dict, List


class _Seen:
    """Factors, each how much slower than predicted something has run, by
    key: each moves halfway toward the median of its last RUN observations,
    within RANGE, and within SNAP of 1 is 1; age() takes a step of the excess
    back, of the factor and of the observations kept (so the next one is
    weighed against aged ones, not the stale run)."""
    SNAP = 0.03
    RANGE = (1.0, 64.0)  # slower than predicted, never faster: the prediction is the optimistic bound
    WEIGHT = 0.5         # of each new target
    RUN: int             # observations the target is the median of
    DECAY: float         # of the excess over 1, per age()
    MIN_BYTES = 1 << 20  # below this a message's time is mostly latency and host work, not the link

    def __init__(self):
        self._lock = threading.Lock()
        self._factor: Dict[object, float] = {}
        self._runs: Dict[object, List[float]] = {}

    def _observe(self, key, nbytes: int, seconds: float, predict: Callable[[], float]) -> None:
        if nbytes < self.MIN_BYTES or seconds <= 0:
            return
        predicted = predict()
        if predicted <= 0:
            return
        lo, hi = self.RANGE
        with self._lock:
            run = self._runs[key] = (self._runs.get(key, []) + [seconds / predicted])[-self.RUN:]
            if len(run) < self.RUN:
                return
            f = self._factor.get(key, 1.0)
            self._factor[key] = self._snap(min(max((1 - self.WEIGHT) * f + self.WEIGHT * statistics.median(run), lo), hi))

    def _age(self, key) -> None:
        with self._lock:
            f = self._factor.get(key)
            if f is not None:
                self._factor[key] = self._snap(1.0 + (f - 1.0) * self.DECAY)
                self._runs[key] = [1.0 + (x - 1.0) * self.DECAY if x > 1.0 else x for x in self._runs.get(key, [])]

    def _snap(self, f: float) -> float:
        return 1.0 if abs(f - 1.0) < self.SNAP else f


class LinkSeen(_Seen):
    """How much slower than calibrated each peer's link ran (shared by many flows, busier than at
    construction), from its raw messages' arrival."""
    RUN = 5              # observations the target is the median of: two stalls (GC pauses) move nothing
    DECAY = 0.95         # of the excess over 1, per compressed message: a freed link is re-measured within ~15

    def factor(self, peer: int) -> float:
        """How much slower than calibrated the link to peer has run (1: as calibrated)."""
        return self._factor.get(peer, 1.0)

    def raw(self, peer: int, nbytes: int, seconds: float, predict: Callable[[], float]) -> None:
        """A raw message of nbytes to peer took seconds to arrive; predict() gives the model's time
        (asked only for a message large enough to say something of the link)."""
        self._observe(peer, nbytes, seconds, predict)

    def coded(self, peer: int) -> None:
        """A compressed message went to peer: the raw figure ages a step."""
        self._age(peer)


class CodedSeen(_Seen):
    """How much slower than predicted a sender's compressed messages to each
    peer have run, per dtype and size class (powers of two: fixed costs weigh
    on small messages, not on large ones). Only a plan slower than predicted is
    re-judged, as with the collectives' slowdown. Each raw message of a class
    takes a step of its excess back, so compression is tried again, and
    re-measured, once raw has run a while."""
    RUN = 3              # observations the target is the median of: one stall moves nothing
    DECAY = 0.9          # of the excess over 1, per raw message of the class

    @staticmethod
    def _key(peer: int, dtype, nbytes: int) -> tuple:
        return peer, dtype, max(int(nbytes), 1).bit_length()

    def factor(self, peer: int, dtype, nbytes: int) -> float:
        """How much slower than predicted compressing nbytes of dtype to peer has run (1: as predicted)."""
        return self._factor.get(self._key(peer, dtype, nbytes), 1.0)

    def coded(self, peer: int, dtype, nbytes: int, seconds: float, predict: Callable[[], float]) -> None:
        """A compressed message of nbytes of dtype to peer took the sender seconds; predict() gives the
        model's time for it (asked only for a message large enough)."""
        self._observe(self._key(peer, dtype, nbytes), nbytes, seconds, predict)

    def raw(self, peer: int, dtype, nbytes: int) -> None:
        """A raw message of nbytes of dtype went to peer: its class's figure ages a step."""
        self._age(self._key(peer, dtype, nbytes))
