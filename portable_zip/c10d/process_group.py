"""The "pz" torch.distributed backend: a ProcessGroup whose ops go through a
pz.Communicator per device kind (compressed where the policy says, torch's
own op where it does not), and whose other ops are forwarded to an inner
backend: gloo for CPU tensors, NCCL/RCCL for GPU ones.

Ranks are the group's own, as torch's ProcessGroup methods take them.
Ops are posted in the caller's order, and two ops on one tensor never run
out of order: forwarded ops first finish the Communicator's queued ones,
and every op first finishes the running ops outside that queue (torch's
own, point to point) on its tensors (order.py)."""
from __future__ import annotations

import functools
import sys
import threading
import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from ..codec import MismatchError, overlaps
from ..comm import (REDUCIBLE, Communicator, Deadline, Group, ReduceOp, Settings, swap_through_store,
                    timeout_of)
from . import native, report, thin, torch_work
from .options import Options
from .order import Backward, Running
from .p2p import P2P
from .staged import staged

_R = dist.ReduceOp.RedOpType
# What gloo reduces (CPU tensors, and GPU ones staged through it).
_GLOO_REDUCES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128))
_KIND = {"gloo": dist.ProcessGroup.BackendType.GLOO, "nccl": dist.ProcessGroup.BackendType.NCCL}
KINDS = ("cpu", "cuda")  # the device kinds pz serves (on ROCm torch, "cuda" is HIP: RCCL inside)


class _Contig:
    """Contiguous stand-ins for strided tensors; outputs get their bytes back once the op is done."""

    def __init__(self):
        self.back = []

    @staticmethod
    def inp(t: torch.Tensor, pg) -> torch.Tensor:
        if t.is_contiguous():
            return t
        pg._early(t.device, [t])  # the stand-in copies t now: earlier ops on it finish first
        return t.contiguous()

    def out(self, t: torch.Tensor, pg) -> torch.Tensor:
        if t.is_contiguous():
            return t
        pg._early(t.device, [t])
        c = t.contiguous()
        self.back.append((t, c))
        return c

    def then(self, first=None):
        """The op's copy-out (None when there is none: torch's own Work may then be returned)."""
        if first is None and not self.back:
            return None
        back = self.back

        def run():
            if first is not None:
                first()
            for t, c in back:
                t.copy_(c)
        return run


def _op(opts) -> Optional[ReduceOp]:
    """Our reduction for torch's, or None (PRODUCT, bitwise, PREMUL_SUM: forwarded)."""
    return ReduceOp.of_torch(thin.kind(opts))


def _one(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"pz backend: {what} takes one tensor per rank (torch's multi-GPU lists are gone), "
                         f"got {len(tensors)}")
    return tensors[0]


def _name(new: str, old: str) -> str:
    """torch's own name of an op: torch 2.13 renamed several."""
    return new if hasattr(dist.ProcessGroup, new) else old


_ALL_GATHER = _name("all_gather_single", "_allgather_base")
_REDUCE_SCATTER = _name("reduce_scatter_single", "_reduce_scatter_base")
_ALL_TO_ALL = _name("all_to_all_single", "alltoall_base")
_COALESCED_AG = _name("all_gather_single_coalesced", "allgather_into_tensor_coalesced")
_COALESCED_RS = _name("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")


def _plain(name=None, thin=None):
    """An op whose tensors are of a device kind not mapped to pz (CPU tensors
    under "cpu:gloo,cuda:pz") goes straight to the inner backend's own op:
    torch hands a Python ProcessGroup every device kind's ops. thin(self,
    *args): the op's thin native path, tried first (its Work, or None)."""
    def wrap(method):
        inner_name = name or method.__name__

        @functools.wraps(method)
        def op(self, *args, **kwargs):
            if thin is not None and not kwargs:
                w = thin(self, *args)
                if w is not None:
                    return w
            t = _first(args)
            if t is not None and t.device.type not in self.devices and t.device.type in self._inner:
                return getattr(self._inner[t.device.type].pg, inner_name)(*args, **kwargs)
            return method(self, *args, **kwargs)
        return op
    return wrap


def _observable(w, outputs, backend: str):
    """A reduce_scatter's Work as the order bookkeeping can see it end: gloo's
    never says it completed, not even once waited for, so Running would hold
    it, and every op after it, for good; as a Joined it says so once waited
    for (and gets the future gloo's lacks). Other backends' Works stay
    torch's own: their futures and stream waits are the backend's."""
    return torch_work.Joined([w], outputs) if backend == "gloo" else w


def _first(args) -> Optional[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            t = _first(a)
            if t is not None:
                return t
    return None


class ProcessGroupPZ(dist.ProcessGroup):
    """Made by torch.distributed (init_process_group / new_group with backend
    "pz"); devices: the device kinds mapped to pz (others are forwarded as
    they are, e.g. CPU tensors under "cpu:gloo,cuda:pz"); None: torch's
    backend config for this group says, read at its first op."""

    def __init__(self, store, rank: int, ranks: List[int], timeout: float, name: str,
                 options: Optional[Options] = None, devices=None):
        super().__init__(rank, len(ranks))
        self.me, self.world = rank, len(ranks)  # size() and rank() cost a call into torch each (~1-8 µs)
        self.options = options = options if options is not None else Options()
        s = Settings.from_env()
        self.timeout = timeout_of(options.timeout if options.timeout is not None else
                                  (s.timeout if s.timeout is not None else timeout), s)
        self._devices = None if devices is None else frozenset(devices)
        self._report = s.stats  # PZ_STATS=1: a summary line at shutdown
        self._name = name
        self._inner: Dict[str, Group] = {}
        self._p2ps: Dict[str, P2P] = {}
        self._comms: Dict[str, Communicator] = {}
        self._running = Running()  # torch's ops and point to point, outside the Communicators' queues
        self._gates: Dict[str, object] = {}  # "cpu": the native gate, where this is a _Gated group
        self._backward = Backward()
        self._lock = threading.RLock()  # DDP's reducer posts from autograd threads
        self._closed = False
        try:
            self._make(store, rank, ranks, name, options)
        except BaseException:
            self.shutdown()  # a failed construction keeps no groups, threads or sockets
            raise

    def _make(self, store, rank: int, ranks: List[int], name: str, options: Options) -> None:
        self._inner["cpu"] = Group(store, rank, ranks, "gloo", self.timeout, f"{name}/cpu")
        # Two ranks on one GPU (transport="fabric") cannot use NCCL: their
        # forwarded GPU ops stage through host memory over gloo instead.
        if torch.cuda.is_available() and options.transport != "fabric":
            self._inner["cuda"] = Group(store, rank, ranks, "nccl", self.timeout, f"{name}/cuda")
        self._register_inner()
        _agree_options(self._inner["cpu"], options, self.timeout)
        # Point to point: per inner kind, groups of its own (NCCL: one per direction).
        for kind, g in self._inner.items():
            groups = tuple(Group(store, rank, ranks, g.backend, self.timeout, f"{name}/{kind}-p2p{d}")
                           for d in (("up", "down") if g.backend == "nccl" else ("",)))
            self._p2ps[kind] = P2P(groups, self._compresses(kind, options.compress), self.timeout,
                                   options.max_sms or 0)

    def _register_inner(self) -> None:
        """torch's C++ calls (ops pz leaves to torch, and _get_backend) reach the inner backends."""
        for kind, g in self._inner.items():
            d = torch.device(kind)
            self._register_backend(d, _KIND[g.backend], g.pg._get_backend(d))
        self._set_default_backend(_KIND[self._inner["cpu"].backend])

    @property
    def devices(self) -> frozenset:
        """The device kinds mapped to pz. torch hands a Python ProcessGroup
        every kind, and tells the map only once the group is made
        (dist.get_backend_config: "cpu:pz,cuda:pz", "cpu:gloo,cuda:pz"), so
        it is read at the first op; a group made outside torch's registry
        serves every kind."""
        if self._devices is None:
            try:
                cfg = dist.get_backend_config(self)
            except (ValueError, TypeError, AssertionError, RuntimeError):  # not in torch's registry
                return frozenset(KINDS)
            pairs = [p.split(":") for p in cfg.split(",")]
            self._devices = frozenset(KINDS) if len(pairs) == 1 and len(pairs[0]) == 1 else \
                frozenset(p[0] for p in pairs if len(p) == 2 and p[1] == "pz")
        return self._devices

    def name(self) -> str:
        return "pz"

    def inner_backend(self) -> str:
        """What a pz.Communicator (or a hook's) made over this group runs on:
        the inner backend of the device kind it serves, NCCL where GPUs are pz's."""
        return "nccl" if "cuda" in self._inner and "cuda" in self.devices else "gloo"

    # --- plumbing -------------------------------------------------------------
    def _comm(self, device: torch.device) -> Optional[Communicator]:
        """This device kind's Communicator, made at its first op (collectively:
        every rank's first op on a device kind makes it), or None where the
        kind is not mapped to pz."""
        kind = device.type
        if kind not in self.devices or self._closed:
            return None
        if kind != "cpu" and "cpu" in self.devices and "cpu" not in self._comms:
            # The CPU's first, whatever op comes first: every rank makes its
            # Communicators in one order, whichever thread posts first.
            self._comm(torch.device("cpu"))
        c = self._comms.get(kind)
        if c is None:
            parent = self._inner.get(kind, self._inner["cpu"])
            dev = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else device
            c = self._comms[kind] = Communicator(group=parent, device=dev, timeout=self.timeout,
                                                 **self.options.communicator_args())
            gate = self._gates.get(kind)
            if gate is not None:  # its native ops go to the Communicator's group; its own ops may change plans
                gate.set_inner(c.group.pg._get_backend(torch.device(kind)))
                c.on_enter = gate.forget
                c.on_stats = functools.partial(_count_gate, gate, weakref.ref(c))
        return c

    def _drain_ours(self, kinds=None) -> None:
        """Run the Communicators' queued ops (of kinds, default all) to the end."""
        for k, c in self._comms.items():
            if kinds is None or k in kinds:
                c.drain()

    def _ours(self, device: torch.device, fn, outputs, then=None, inputs=(), rs: bool = False):
        """fn(Communicator, kw) on this device kind's Communicator, as a torch Work; kw: the async
        collective's arguments (torch_work: an op that runs torch's own collective may return its Work)."""
        with self._lock:
            c = self._comm(device)
            if c is None:
                return None
            self._running.settle(outputs, inputs)
            res = fn(c, {"async_op": True, "torch_work": then is None})
            if isinstance(res, dist.Work):  # torch's own op (an idle native plan): runs beside the queue
                w = _observable(res, outputs, c.group.backend) if rs else res
                return self._backward.add(self._running.add(w, outputs, inputs), c)
            if res is None:
                return torch_work.done(outputs)
            w = torch_work.TorchWork([res], outputs, then)
            if then is not None:  # its copy-out runs after the queue has moved on
                self._running.add(w, outputs, inputs)
            return self._backward.add(w)

    def post_thin(self, op: str, t: torch.Tensor, sent: int, post, writes, reads=()):
        """post(inner): torch's own op on t's Communicator's group, when that
        Communicator would run op on t native now (t checked by the caller,
        thin.py); its Work, or None (the full path runs)."""
        kind = "cuda" if t.is_cuda else "cpu"
        c = self._comms.get(kind)
        if c is None:  # not made yet, or the kind is not pz's
            return None
        with self._lock:
            if not c.native_ready(op, t):
                return None
            if self._running:
                self._running.settle(writes, reads)
            w = c.post_native(op, post, sent)
            if op == "reduce_scatter":
                w = _observable(w, writes, c.group.backend)
            gate = self._gates.get(kind)
            if gate is not None and op in _GATE_OPS and self._running.idle():
                # Nothing of Python's outstanding: the gate posts this op's like from now on.
                gate.track(w, list(writes), list(reads))
                gate.allow(_GATE_OPS[op], t)
                gate.open()
                return self._backward.add(w, c)
            return self._backward.add(self._running.add(w, writes, reads), c)

    def _early(self, device: torch.device, tensors) -> None:
        """An op that reads its tensors as it is posted (a non-contiguous
        tensor's stand-in, a list's concatenation, an in-place input's copy)
        first lets every earlier op on them finish."""
        with self._lock:
            self._running.settle((), tensors)
            self._drain_ours((device.type,))

    def _forward(self, device: torch.device, name: str, *args):
        """torch's own op on the inner backend (staged through host memory
        where GPU tensors have no NCCL here)."""
        with self._lock:
            self._drain_ours()
            writes, reads = ((), args) if name == "send" else (args, ())  # other ops may write any tensor
            self._running.settle(writes, reads)
            inner = self._inner.get(device.type)
            if inner is None:
                return staged(self._inner["cpu"].pg, name, args)
            w = getattr(inner.pg, name)(*args)
            if name in ("send", "recv"):
                w = torch_work.Joined([w], args[0])  # gloo's may be waited for once: settle() waits too
            elif name in (_REDUCE_SCATTER, "reduce_scatter"):
                w = _observable(w, args[0] if isinstance(args[0], list) else [args[0]], inner.backend)
            return self._running.add(w, writes, reads)

    def _served(self, t, dtype_ok=True) -> bool:
        return thin.dense(t) and dtype_ok and t.device.type in self.devices

    # --- collectives ------------------------------------------------------------
    @_plain(thin=thin.all_reduce)
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else c10d.AllreduceOptions()
        t, op = _one(tensors, "all_reduce"), _op(opts)
        if op is not None and self._served(t, t.dtype in REDUCIBLE):
            k = _Contig()
            tc = k.out(t, self)
            return self._ours(t.device, lambda c, kw: c.all_reduce(tc, op=op, **kw), [t], k.then())
        self._reducible("all_reduce", t, opts)
        return self._forward(t.device, "allreduce", tensors, opts)

    def _reducible(self, name: str, t, opts) -> None:
        """A reduction the inner backend cannot do raises here, naming op and dtype (gloo's own error names neither)."""
        if not isinstance(t, torch.Tensor) or (t.is_cuda and "cuda" in self._inner):
            return  # NCCL's own errors
        if t.dtype not in _GLOO_REDUCES:
            raise TypeError(f"pz backend: {name} of {t.dtype} is not supported: pz reduces bfloat16, float16, "
                            f"float32 and float64, and its inner gloo only {sorted(str(d) for d in _GLOO_REDUCES)}")
        if thin.kind(opts) == _R.AVG and not t.dtype.is_floating_point:
            raise TypeError(f"pz backend: {name} with AVG of {t.dtype}: an average of integers is not an integer")

    @_plain(thin=thin.broadcast)
    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else c10d.BroadcastOptions()
        t = _one(tensors, "broadcast")
        if self._served(t):
            k = _Contig()
            tc = k.out(t, self)
            return self._ours(t.device, lambda c, kw: c.broadcast(tc, opts.rootRank, **kw), [t], k.then())
        return self._forward(t.device, "broadcast", tensors, opts)

    @_plain(_ALL_GATHER, thin=thin.all_gather(_ALL_GATHER))
    def all_gather_single(self, out, inp, opts=None):
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if self._served(inp) and thin.dense(out) and out.dtype == inp.dtype and out.numel() == self.world * inp.numel():
            if overlaps(out, inp) and inp.data_ptr() != out.data_ptr() + self.me * inp.nbytes:
                self._early(inp.device, [out, inp])  # the Communicator copies inp now
            k = _Contig()
            oc, ic = k.out(out, self), k.inp(inp, self)
            return self._ours(inp.device, lambda c, kw: c.all_gather_single(oc, ic, **kw), [out], k.then(), [inp])
        return self._forward(inp.device, _ALL_GATHER, out, inp, opts)

    _allgather_base = all_gather_single  # torch < 2.13

    @_plain()
    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else c10d.AllgatherOptions()
        inp = _one(inputs, "all_gather")
        outs = output_lists[0] if len(output_lists) == 1 else []
        if (self._served(inp) and len(outs) == self.size()
                and all(thin.dense(o) and o.dtype == inp.dtype and o.numel() == inp.numel() for o in outs)):
            flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype, device=inp.device)
            n = inp.numel()

            def then():
                for r, o in enumerate(outs):
                    o.copy_(flat[r * n:(r + 1) * n].view(o.shape))
            ic = _Contig.inp(inp, self).reshape(-1)
            return self._ours(inp.device, lambda c, kw: c.all_gather_single(flat, ic, **kw), output_lists, then,
                              [inp])
        return self._forward(inp.device, "allgather", output_lists, inputs, opts)

    @_plain(_REDUCE_SCATTER, thin=thin.reduce_scatter(_REDUCE_SCATTER))
    def reduce_scatter_single(self, out, inp, opts=None):
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        op = _op(opts)
        if (op is not None and self._served(inp, inp.dtype in REDUCIBLE) and thin.dense(out) and out.dtype == inp.dtype
                and inp.numel() == self.size() * out.numel()):
            if overlaps(out, inp):
                self._early(inp.device, [out, inp])  # the Communicator copies inp now
            k = _Contig()
            oc, ic = k.out(out, self), k.inp(inp, self)
            return self._ours(inp.device, lambda c, kw: c.reduce_scatter_single(oc, ic, op=op, **kw), [out],
                              k.then(), [inp], rs=True)
        self._reducible("reduce_scatter", inp, opts)
        return self._forward(inp.device, _REDUCE_SCATTER, out, inp, opts)

    _reduce_scatter_base = reduce_scatter_single

    @_plain()
    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        out, op = _one(outputs, "reduce_scatter"), _op(opts)
        ins = input_lists[0] if len(input_lists) == 1 else []
        if (op is not None and self._served(out, out.dtype in REDUCIBLE) and len(ins) == self.size()
                and all(thin.dense(i) and i.dtype == out.dtype and i.numel() == out.numel() for i in ins)):
            self._early(out.device, [outputs, ins])
            flat = torch.cat([i.reshape(-1) for i in ins])
            k = _Contig()
            oc = k.out(out, self).view(-1)
            return self._ours(out.device, lambda c, kw: c.reduce_scatter_single(oc, flat, op=op, **kw), outputs,
                              k.then(), rs=True)
        self._reducible("reduce_scatter", out, opts)
        return self._forward(out.device, "reduce_scatter", outputs, input_lists, opts)

    @_plain(_ALL_TO_ALL)
    def all_to_all_single(self, out, inp, out_splits, in_splits, opts=None):
        opts = opts if opts is not None else c10d.AllToAllOptions()
        if self._served(inp) and thin.dense(out) and out.dtype == inp.dtype:
            o, i = (list(out_splits) or None), (list(in_splits) or None)
            if overlaps(out, inp):
                self._early(inp.device, [out, inp])  # the Communicator copies inp now
            k = _Contig()
            oc, ic = k.out(out, self), k.inp(inp, self)
            return self._ours(inp.device, lambda c, kw: c.all_to_all_single(oc, ic, o, i, async_op=True), [out],
                              k.then(), [inp])
        return self._forward(inp.device, _ALL_TO_ALL, out, inp, out_splits,
                             in_splits, opts)

    alltoall_base = all_to_all_single

    @_plain()
    def alltoall(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else c10d.AllToAllOptions()
        ts = list(outputs) + list(inputs)
        if (ts and len(outputs) == len(inputs) == self.size() and all(self._served(t) for t in ts)
                and len({t.dtype for t in ts}) == 1 and len({t.device for t in ts}) == 1):
            self._early(ts[0].device, ts)
            flat_in = torch.cat([t.reshape(-1) for t in inputs])
            flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype, device=flat_in.device)
            o, i = [t.numel() for t in outputs], [t.numel() for t in inputs]

            def then():
                for t, piece in zip(outputs, torch.split(flat_out, o)):
                    t.copy_(piece.view(t.shape))
            return self._ours(flat_in.device, lambda c, kw: c.all_to_all_single(flat_out, flat_in, o, i, async_op=True),
                              outputs, then)
        return self._forward(_device(ts), "alltoall", outputs, inputs, opts)

    @_plain(_COALESCED_AG)
    def all_gather_single_coalesced(self, outs, ins, opts=None):
        return self._coalesced(outs, ins, opts, self.all_gather_single, c10d.AllgatherOptions)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_plain(_COALESCED_RS)
    def reduce_scatter_single_coalesced(self, outs, ins, opts=None):
        return self._coalesced(outs, ins, opts, self.reduce_scatter_single, c10d.ReduceScatterOptions)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _coalesced(self, outs, ins, opts, one, make):
        opts = opts if opts is not None else make()
        ws = [one(o, i, opts) for o, i in zip(outs, ins)]
        return torch_work.joined(ws, list(outs))

    # --- forwarded as they are ----------------------------------------------------
    @_plain()
    def allreduce_coalesced(self, tensors, opts=None):
        return self._forward(_device(tensors), "allreduce_coalesced", tensors,
                             opts if opts is not None else c10d.AllreduceCoalescedOptions())

    @_plain()
    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self._forward(_device(inputs), "allgather_coalesced", output_lists, inputs,
                             opts if opts is not None else c10d.AllgatherOptions())

    @_plain()
    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else c10d.ReduceOptions()
        self._reducible("reduce", _one(tensors, "reduce"), opts)
        return self._forward(_device(tensors), "reduce", tensors, opts)

    @_plain()
    def gather(self, outputs, inputs, opts=None):
        return self._forward(_device(inputs), "gather", outputs, inputs,
                             opts if opts is not None else c10d.GatherOptions())

    @_plain()
    def scatter(self, outputs, inputs, opts=None):
        return self._forward(_device(outputs), "scatter", outputs, inputs,
                             opts if opts is not None else c10d.ScatterOptions())

    def barrier(self, opts=None):
        """Every rank's earlier ops posted, then the inner gloo barrier."""
        return self._forward(torch.device("cpu"), "barrier", opts if opts is not None else c10d.BarrierOptions())

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        with self._lock:
            self._drain_ours()
        return self._inner["cpu"].pg._get_backend(torch.device("cpu")).monitored_barrier(timeout, wait_all_ranks)

    # --- point to point -------------------------------------------------------------
    # torch's matching: each send meets the peer's recv in posting order per
    # tag, whatever either side batches or waits on (p2p.py).
    @_plain()
    def send(self, tensors, dst: int, tag: int = 0):
        return self._p2p("send", tensors, dst, tag)

    @_plain()
    def recv(self, tensors, src: int, tag: int = 0):
        return self._p2p("recv", tensors, src, tag)

    def _p2p(self, kind: str, tensors, peer: int, tag: int):
        t = _one(tensors, kind)
        if not self._served(t):
            return self._forward(t.device, kind, tensors, peer, tag)
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"pz backend: {kind} peer {peer} is not another rank of this group (size {self.size()})")
        with self._lock:
            self._drain_ours((t.device.type,))  # its queued ops on this tensor go first
            writes, reads = ((), [t]) if kind == "send" else ([t], ())
            self._running.settle(writes, reads)
            p = self._p2ps[t.device.type if t.device.type in self._inner else "cpu"]
            if kind == "send":
                w = p.send(_Contig.inp(t, self), peer, tag)
            elif t.is_contiguous():
                w = p.recv(t, peer, tag)
            else:
                k = _Contig()
                w = torch_work.then(p.recv(k.out(t, self), peer, tag), [t], k.then())
            return self._running.add(w, writes, reads)

    def _compresses(self, kind: str, mode: str):
        """The sender's plan for a point-to-point tensor: the mode, and under
        auto the device kind's calibrated policy once a collective has made
        its Communicator (until then, raw: never slower than torch's own)."""
        def compresses(t) -> bool:
            if mode != "auto":
                return mode == "always"
            c = self._comms.get(t.device.type)
            return c is not None and c.policy.choose("send", t.dtype, t.nbytes, 2) == "compressed"
        return compresses

    @_plain()
    def recv_anysource(self, tensors, tag: int = 0):
        raise RuntimeError("pz backend: recv from any source (dist.recv(src=None)) is not supported: name the "
                           "source rank; pz matches transfers per peer in posting order, as NCCL does")

    def _start_coalescing(self, device):
        pass  # each isend/irecv is posted at once and matched in order: nothing to group

    def _end_coalescing(self, device):
        return torch_work.done([])

    # --- life -------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._report:
                line = report.summary(self.stats, self._name, self.rank(), self.size())
                if line:
                    print(line, file=sys.stderr, flush=True)
            self._closed = True
            for g in self._gates.values():  # its counts stay for the Communicator's stats (on_stats)
                g.release()
            comms, self._comms = list(self._comms.values()), {}
            for c in comms:
                c.close()
            p2ps, self._p2ps = list(self._p2ps.values()), {}  # their pays() closures hold self: no cycle
            for p in p2ps:
                p.close()
            for g in self._inner.values():
                g.close()

    abort = shutdown

    @property
    def stats(self) -> dict:
        """Per device kind, its Communicator's per-op stats (pz.Communicator.stats),
        with point to point's (send, recv) beside them."""
        out = {k: dict(c.stats) for k, c in self._comms.items()}
        for k, p in self._p2ps.items():
            v = p.stats.view()
            if v:
                out.setdefault(k, {}).update(v)
        return out

    @property
    def native_gate(self) -> str:
        """How this group posts native ops, in words: through the native gate
        (gate.cpp, a C++ backend: torch's cost), or the Python thin path and why."""
        if self._gates or native.load() is None:
            return native.reason()
        return "Python thin path: the gate serves processes without a GPU for now"

    def gate_posted(self, device="cpu") -> int:
        """Native ops of device's kind that the gate posted itself (0 without one)."""
        g = self._gates.get(torch.device(device).type)
        return g.posted() if g is not None else 0

    def communicator(self, device="cpu") -> Optional[Communicator]:
        """The Communicator that serves device's tensors, once an op made it."""
        return self._comms.get(torch.device(device).type)


_GATE_OPS = {"all_reduce": 0, "broadcast": 1, "all_gather": 2}  # the native gate's ops, gate.cpp's numbering


def _count_gate(gate, comm) -> None:
    """The native ops the gate posted, into its Communicator's stats (comm: a weak reference)."""
    c = comm()
    if c is not None:
        for op, (calls, sent, ns) in gate.counts().items():
            c.count_native(op, calls, sent, ns * 1e-9)


def _torch_method(name: str):
    """torch's own ProcessGroup method, as its class holds it (the attribute
    read through the class is pybind's function bound to its record, not a
    method a subclass can take over)."""
    for k in dist.ProcessGroup.__mro__:
        if name in vars(k):
            return vars(k)[name]
    return None


class _Gated(ProcessGroupPZ):
    """A pz group (of a process without a GPU) whose all_reduce, broadcast and
    all_gather_into_tensor torch dispatches in C++ to the native gate
    (gate.cpp): a native op goes from there to the Communicator's group with
    no Python on the way, anything else comes back to ProcessGroupPZ's Python
    methods."""

    _py_allreduce = ProcessGroupPZ.allreduce
    _py_broadcast = ProcessGroupPZ.broadcast
    _py_all_gather = ProcessGroupPZ.all_gather_single
    allreduce = _torch_method("allreduce")
    broadcast = _torch_method("broadcast")
    _allgather_base = _torch_method("_allgather_base")
    if _torch_method("all_gather_single") is not None:
        all_gather_single = _torch_method("all_gather_single")

    def _register_inner(self) -> None:
        # gloo stays the default backend (sequence numbers, timeouts: torch asks it by type); the CPU
        # device's ops go to the gate, registered under a type of its own after it.
        super()._register_inner()
        me = weakref.ref(self)  # the gate lives inside torch's group: no cycle through it

        def fallback(name, *args):
            pg = me()
            if pg is None:
                raise RuntimeError("pz backend: this group is gone")
            return getattr(pg, "_py_" + name)(*args)
        gate = self._gates["cpu"] = native.load().Gate(self.me, self.world, "cpu")
        gate.set_fallback(fallback)
        gate.set_base(self._inner["cpu"].pg._get_backend(torch.device("cpu")))
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, gate)
        self._running.gates = (gate,)


def make(*args, **kwargs) -> ProcessGroupPZ:
    """A pz group: with the native gate where it is built for this torch and
    the process has no GPU (torch keeps one backend per type, and a GPU's ops
    must reach pz's Python path and NCCL's own handling: the CUDA gate is the
    next GPU run's)."""
    gated = native.load() is not None and not torch.cuda.is_available()
    return (_Gated if gated else ProcessGroupPZ)(*args, **kwargs)


def _device(tensors) -> torch.device:
    t = torch_work.first_tensor(tensors)
    if t is None:
        raise ValueError("pz backend: an op with no tensors")
    return t.device


def _agree_options(group: Group, options: Options, timeout: float) -> None:
    """Every rank made this group with the same options (point to point
    decides what travels from them), else MismatchError on every rank."""
    mine = repr((options.compress, options.transport, options.domains))
    seen = [v.decode() for v in swap_through_store(group, "options", mine, Deadline(timeout), "its pz options")]
    if len(set(seen)) > 1:
        raise MismatchError("ranks made this pz group with different options (compress, transport, domains): " +
                            ", ".join(f"rank {j} {v}" for j, v in enumerate(seen)))
