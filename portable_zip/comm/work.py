"""Async ops: one worker thread per Communicator runs them in submission
order, each under its caller's CUDA stream; a Work handle waits for one."""
from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Callable, List, Optional

import torch

from .errors import PeerTimeout


class Work:
    """Handle of an async op: wait() blocks until it is done (and re-raises its error)."""

    def __init__(self, future: concurrent.futures.Future, flush: Optional[Callable[[], None]] = None):
        self._future = future
        self._flush = flush

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the op is done (re-raising its error). The op itself is
        bounded by its Communicator's timeout; timeout (seconds) only bounds
        this wait: past it, PeerTimeout says the op is still running."""
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
        if timeout is not None and timeout > threading.TIMEOUT_MAX:
            timeout = None  # inf: the op's own timeout bounds it
        if self._flush is not None:
            # An unbounded wait runs the posted group itself (no hop to the worker).
            self._flush(inline=timeout is None)
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():  # done as the wait expired: its own outcome (PeerTimeout is a TimeoutError)
                self._future.result()
                return True
            raise PeerTimeout(f"the op did not finish within wait(timeout={timeout:g}); it is still running, "
                              "wait() again") from None
        return True

    def start(self) -> "Work":
        """Post now, without waiting: a point-to-point op goes out with the
        ones posted before it, as one group (a later isend starts another)."""
        if self._flush is not None:
            self._flush(inline=False)
        return self

    def is_completed(self) -> bool:
        return self._future.done()

    def result(self):
        """wait(), then the op's value (recv_tensor's tensor; None for the rest)."""
        self.wait()
        return self._future.result()


def exclusive(op: Callable) -> Callable:
    """A Communicator method that one thread at a time may be inside: a
    second thread entering while another is inside raises at once, never
    interleaving with it (interleaved ops pair wrongly with the peers'). Nested
    calls on the thread inside pass; sequential calls from any thread pass."""
    @functools.wraps(op)
    def entered(self, *args, **kwargs):
        me, lock = threading.get_ident(), self._entry
        if self._inside == me:
            return op(self, *args, **kwargs)
        if not lock.acquire(blocking=False):
            raise RuntimeError("pz.Communicator is not thread-safe: this thread called it while another thread "
                               "is inside an op on it; use one Communicator per thread or serialize the calls "
                               "(sequential use from different threads is fine)")
        self._inside = me
        try:
            if self.on_enter is not None:  # the pz backend's native gate: this op may change plans
                self.on_enter()
            return op(self, *args, **kwargs)
        finally:
            self._inside = None
            lock.release()
    return entered


class Worker:
    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pz-comm",
            initializer=(lambda: torch.cuda.set_device(device)) if self._cuda else None)
        self._outstanding: List[concurrent.futures.Future] = []

    def busy(self) -> bool:
        """An op is queued or running (done ones may linger until the next submit)."""
        return any(not f.done() for f in self._outstanding)

    def submit(self, fn: Callable[[], None]) -> concurrent.futures.Future:
        """fn on the worker, under the caller's current CUDA stream."""
        stream = torch.cuda.current_stream() if self._cuda else None

        def run():
            if stream is None:
                return fn()
            with torch.cuda.stream(stream):
                return fn()
        fut = self._pool.submit(run)
        # Done ones leave (async ops nobody drains would otherwise hold every
        # op's future, its callbacks and through them the op's tensors).
        self._outstanding = [f for f in self._outstanding if not f.done()]
        self._outstanding.append(fut)
        return fut

    def drain(self) -> None:
        """Wait for queued ops (their errors stay with their futures)."""
        while self._outstanding:
            concurrent.futures.wait([self._outstanding.pop(0)])

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
