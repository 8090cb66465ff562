"""Order and failure for the pz backend's async ops.

Ops of a Communicator run in its queue's order. Ops outside that queue run
side by side: torch's own (forwarded ops, and native plans under "auto"),
which gloo runs on two threads per group and on several groups at once,
and point to point. `Running` holds those until they finish, and an op on
the same tensors waits for them first.

DDP's reducer cannot take a failed future from a Python backend (it pickles
the value to find its tensor: torch_work._Failed), so `Backward` waits for the
ops a backward pass posts in a callback at its end, before the reducer's
own: a failure raises PeerError from backward()."""
from __future__ import annotations

import functools
from typing import List, Tuple

import torch

from ..comm import Deadline

_ANY = "any"  # a tensor without strided storage: it overlaps everything
_NONE: frozenset = frozenset()


def storages(tensors) -> frozenset:
    """The storages an op's tensors (nested lists of them) live in."""
    if type(tensors) in (list, tuple) and len(tensors) <= 1:  # the usual op: none, or one plain tensor
        if not tensors:
            return _NONE
        if type(tensors[0]) is torch.Tensor and tensors[0].layout == torch.strided:
            return frozenset((tensors[0].untyped_storage().data_ptr(),))
    out, todo = [], [tensors]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            out.append(x.untyped_storage().data_ptr() if x.layout == torch.strided else _ANY)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return frozenset(out)


class Running:
    """Works outside the Communicator's queue, each with the storages it
    writes and reads. An op waits for those it conflicts with: a write
    after any use, a read after a write (two reads may overlap)."""

    def __init__(self):
        self._works: List[Tuple[object, frozenset, frozenset]] = []
        self.gates = ()  # native gates (gate.cpp): the ops they posted join this list before anything reads it

    def __len__(self) -> int:
        self._absorb()
        return len(self._works)

    def _absorb(self) -> None:
        """The gates' posted ops, in their order; each gate is shut by it (Python runs next)."""
        for g in self.gates:
            for w, writes, reads in g.take():
                self._works.append((w, storages(writes), storages(reads)))

    SWEEP = 32  # past this many held, every finished one leaves (one unfinished at the front pins none)

    def add(self, w, writes, reads=()):
        works = self._fresh()
        if len(works) >= self.SWEEP:
            works[:] = [x for x in works if not x[0].is_completed()]
        works.append((w, storages(writes), storages(reads)))
        return w

    def idle(self) -> bool:
        """Nothing held that has not finished."""
        return not self._fresh()

    def _fresh(self) -> list:
        """The works held, the gates' included, less the finished ones at the front (they
        hold their tensors): works mostly finish in posting order, so this asks one or two, not all."""
        self._absorb()
        works = self._works
        while works and works[0][0].is_completed():
            del works[0]
        return works

    def settle(self, writes, reads=()) -> None:
        """Those this op conflicts with finish first (their errors belong to their own wait())."""
        works = self._fresh()  # mostly the last op's held, done: nothing to compare
        if not works:
            return
        ws, rs = storages(writes), storages(reads)
        keep = []
        for w, ow, orr in self._works:
            if _meet(ws, ow | orr) or _meet(rs, ow):
                if not w.is_completed():
                    try:
                        w.wait()
                    except Exception:  # noqa: BLE001 - reported by its own wait()
                        pass
            else:
                keep.append((w, ow, orr))
        self._works = keep


def _meet(a: frozenset, b: frozenset) -> bool:
    return bool(a and b and (a & b or _ANY in a or _ANY in b))


class Backward:
    """The ops posted during each backward pass, waited for at its end."""

    def __init__(self):
        self._task, self._ops = -1, []

    def add(self, w, comm=None):
        """w (comm: the Communicator whose native plan it is) if posted in a
        backward: a final callback of that backward waits for it. The
        reducer queues its callback at its last bucket, after this one."""
        task = torch._C._current_graph_task_id()
        if task >= 0:
            if task != self._task:  # the list lives in its callback: a backward that fails drops both
                self._task, self._ops = task, []
                torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_wait_all, self._ops))
            self._ops.append((w, comm))
        return w


def _wait_all(ops) -> None:
    """Ours raise PeerError; torch's own (native plans) get the wait a
    blocking native op gets, which names a dead peer: one wait per
    Communicator for all of them (each such wait hands off to a waiter
    thread: per op, that cost FSDP2 a tenth of its step on 2 cores)."""
    native = {}
    for w, comm in ops:
        if comm is None:
            w.wait()
        else:
            native.setdefault(id(comm), (comm, []))[1].append(w)
    for comm, works in native.values():
        comm._await_native(works, Deadline(comm.timeout), detached=True)
