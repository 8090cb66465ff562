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
tried raw again, and re-measured."""
from __future__ import annotations

import statistics
import threading
from typing import Callable, Dict, List


class LinkSeen:
    RANGE = (1.0, 64.0)  # slower than calibrated (shared by many flows), never faster: calibration is the optimistic bound
    WEIGHT = 0.5         # of each new target
    RUN = 5              # observations the target is the median of: two stalls (GC pauses) move nothing
    DECAY = 0.95         # of the excess over 1, per compressed message: a freed link is re-measured within ~15
    MIN_BYTES = 1 << 20  # below this a message's time is mostly latency and host work, not the link

    def __init__(self):
        self._lock = threading.Lock()
        self._factor: Dict[int, float] = {}
        self._runs: Dict[int, List[float]] = {}

    def factor(self, peer: int) -> float:
        """How much slower than calibrated the link to peer has run (1: as calibrated)."""
        return self._factor.get(peer, 1.0)

    def raw(self, peer: int, nbytes: int, seconds: float, predict: Callable[[], float]) -> None:
        """A raw message of nbytes to peer took seconds to arrive; predict() gives the model's time
        (asked only for a message large enough to say something of the link)."""
        if nbytes < self.MIN_BYTES or seconds <= 0:
            return
        predicted = predict()
        if predicted <= 0:
            return
        lo, hi = self.RANGE
        with self._lock:
            run = self._runs[peer] = (self._runs.get(peer, []) + [seconds / predicted])[-self.RUN:]
            if len(run) < self.RUN:
                return
            f = self._factor.get(peer, 1.0)
            self._factor[peer] = min(max((1 - self.WEIGHT) * f + self.WEIGHT * statistics.median(run), lo), hi)

    def coded(self, peer: int) -> None:
        """A compressed message went to peer: the raw figure ages a step."""
        with self._lock:
            f = self._factor.get(peer)
            if f is not None:
                self._factor[peer] = 1.0 + (f - 1.0) * self.DECAY
