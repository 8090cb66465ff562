"""torch.distributed Work objects for the pz backend's ops: what DDP's
reducer, FSDP2 and user code wait on, poll and chain futures from."""
from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import Work


def _seconds(timeout) -> Optional[float]:
    """torch passes timedelta(0) for "no limit of this wait's own"."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return s if s > 0 else None


class TorchWork(dist.Work):
    """One or more pz ops seen as one torch Work. Its future's value is
    `outputs` (torch's rule: the op's output tensors), set once every op is
    done and `then` (a copy-out, for list-form ops) has run, under the
    CUDA stream the op was posted on."""

    def __init__(self, works: Sequence[object], outputs: List[torch.Tensor],
                 then: Optional[Callable[[], None]] = None):
        super().__init__()
        self._works, self._outputs, self._then = list(works), outputs, then
        self._stream = None
        devices = []
        first = first_tensor(outputs)
        if first is not None and first.is_cuda:
            self._stream = torch.cuda.current_stream(first.device)
            devices = [first.device]
        self._future = torch.futures.Future(devices=devices)
        self._left = len(self._works)
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        if not self._works:
            self._finish()
        for w in self._works:
            if isinstance(w, Work):
                w._future.add_done_callback(lambda f: self._one_done(f.exception()))
            else:  # torch's own (a forwarded or native op of a coalesced call)
                w.get_future().add_done_callback(lambda f: self._one_done(_error_of(f)))

    def _one_done(self, e: Optional[BaseException]) -> None:
        # Runs where the op completes (or here, if already done): the last op finishes the Work.
        with self._lock:
            if e is not None and self._error is None:
                self._error = e
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            if self._error is None and self._then is not None:
                try:
                    self._then()
                except BaseException as e:  # noqa: BLE001 - the waiter sees it
                    self._error = e
            # Done: let go of the ops. Their futures hold callbacks that hold
            # this Work, a cycle through torch's C++ objects that Python's gc
            # cannot see (it kept every op's tensors alive).
            self._works, self._then = [], None
            if self._error is not None:
                fail(self._future, self._error)
            else:
                self._future.set_result(self._outputs)

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            if isinstance(w, Work):
                w.wait(_seconds(timeout))  # flushes pending isend/irecv; raises the op's error
            else:
                w.wait(timeout) if timeout is not None else w.wait()
        self._future.wait()  # the copy-out, if any; its error
        if self._stream is not None:
            cur = torch.cuda.current_stream(self._stream.device)
            if cur != self._stream:  # NCCL's rule: the waiting stream is ordered after the op
                cur.wait_stream(self._stream)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._error is None

    def exception(self):
        return self._error

    def get_future(self) -> torch.futures.Future:
        for w in self._works:
            if isinstance(w, Work):
                w.start()  # a future nobody waits on must still run
        return self._future

    def result(self) -> List[torch.Tensor]:
        return self._outputs


class _Failed:
    """A failed op's value in its torch future. A Python future cannot hold
    an error that C++ sees: set_exception stores the exception as the value,
    and DDP's reducer (parseCppCommHookResult) pickles a Python value to
    take its first tensor, indexing an empty list (SIGSEGV). Pickling this
    raises the op's error there instead, which backward() raises."""

    def __init__(self, e: BaseException):
        self.e = e

    def __reduce_ex__(self, protocol):
        raise self.e


def _unwrap(v):
    raise v.e


def fail(fut: torch.futures.Future, e: BaseException) -> None:
    """Complete fut with e: Python's wait() and value() raise e, and so does C++'s look at its tensors."""
    fut._set_unwrap_func(_unwrap)
    fut.set_result(_Failed(e))


def first_tensor(x) -> Optional[torch.Tensor]:
    """The first tensor of outputs (a list, or torch's list of lists)."""
    if isinstance(x, torch.Tensor):
        return x
    for v in x:
        t = first_tensor(v)
        if t is not None:
            return t
    return None


def _error_of(fut) -> Optional[BaseException]:
    try:
        fut.wait()
    except BaseException as e:  # noqa: BLE001 - handed to the waiter
        return e
    return None


def joined(ws, outputs: List[torch.Tensor]):
    """Several ops' Works (ours or torch's) as one: a coalesced call."""
    if not any(isinstance(w, TorchWork) for w in ws):
        return Joined(ws, outputs)
    return TorchWork([x for w in ws for x in (w._works if isinstance(w, TorchWork) else [w])], outputs)


class Joined(dist.Work):
    """torch Works as one, with no thread of its own: gloo's send and recv
    Works have no future, so one is made (by a thread that waits) only for
    a caller who asks for it."""

    def __init__(self, ws, outputs: List[torch.Tensor]):
        super().__init__()
        self._ws, self._outputs, self._future = list(ws), outputs, None
        # gloo's send/recv Works may be waited for once: a second waiter
        # (the future's thread beside the caller) waits for the next
        # transfer's completion, which never comes.
        self._lock, self._waited = threading.Lock(), False

    def wait(self, timeout=None) -> bool:
        s = _seconds(timeout)
        if not self._lock.acquire(timeout=-1 if s is None else s):
            raise RuntimeError(f"pz backend: wait timed out after {s:g} s (another thread is waiting for this Work)")
        try:
            if not self._waited:
                for w in self._ws:
                    w.wait(timeout) if timeout is not None else w.wait()
                self._waited = True
        finally:
            self._lock.release()
        return True

    def is_completed(self) -> bool:
        return self._waited or all(w.is_completed() for w in self._ws)

    def result(self) -> List[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            fut = self._future = torch.futures.Future()
            me = [self]

            def run():
                j = me.pop()
                try:
                    j.wait()
                    err = None
                except BaseException as e:  # noqa: BLE001 - handed to the future
                    err = e
                out = j._outputs
                # Let go of gloo's Works before the future's waiters go on: their destructor
                # retakes the GIL, which ends a daemon thread in std::terminate once Python exits.
                del j
                if err is None:
                    fut.set_result(out)
                else:
                    fail(fut, err)
            threading.Thread(target=run, name="pz-future", daemon=True).start()
        return self._future


def then(w, outputs: List[torch.Tensor], fn: Callable[[], None]) -> TorchWork:
    """w (ours or torch's), then fn once it is done: one Work."""
    # A Joined stays whole: gloo's send/recv Works have no future, a Joined makes one.
    return TorchWork(w._works if isinstance(w, TorchWork) else [w], outputs, fn)


def done(outputs: List[torch.Tensor]) -> TorchWork:
    """A Work that is already complete (ops served on the calling thread)."""
    return TorchWork([], outputs)
