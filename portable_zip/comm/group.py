"""A process group of our own: torch's gloo or NCCL/RCCL backend built
straight from a store, never entered in torch.distributed's registry. The
Communicator's private group, its domain groups and the pz backend's inner
groups are all of this kind, so one code path serves a Communicator made
over a torch group and the backend torch makes while it initializes (when
no torch group can be made yet). Ranks are the group's own throughout."""
from __future__ import annotations

import datetime
import os
import threading
from collections import defaultdict
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroup

from .errors import PeerTimeout

_made = defaultdict(int)  # parent name -> groups made from it (the same on every rank of a correct program)
_made_lock = threading.Lock()


def _opts(cls, **fields):
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


_OPTS: dict = {}


def _cached(cls, **fields):
    """An options object per distinct value: making one costs ~10-30 µs of a
    small op's host time, and torch only reads them."""
    key = (cls, *fields.items())  # callers name fields in a fixed order
    o = _OPTS.get(key)
    if o is None:
        o = _OPTS[key] = _opts(cls, **fields)
    return o


class Group:
    """size ranks over `store` (keys under name), moving `backend`'s tensors:
    "gloo" (CPU) or "nccl" (NCCL on CUDA, RCCL on ROCm). ranks: the global
    rank of each member."""

    def __init__(self, store, rank: int, ranks: Sequence[int], backend: str, timeout: float, name: str):
        self.rank, self.size, self.ranks = rank, len(ranks), list(ranks)
        self.backend, self.timeout = backend, float(timeout)
        self.secret = _run_secret(PrefixStore(f"pz/{name}/", store), rank, self.timeout)
        # Differs per run: nobody can write this run's keys ahead of it.
        self.name = name = f"{name}.{self.secret[:6].hex()}"
        self.store = PrefixStore(f"pz/{name}/", store)  # ours: swaps (store.py) and the backend's rendezvous
        self._base = store
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.pg = _build(PrefixStore(f"pg/{name}/", store), rank, self.ranks, backend, self.timeout, name)

    @classmethod
    def of(cls, parent, timeout: float, backend: Optional[str] = None) -> "Group":
        """A new group of parent's ranks (a torch group or a Group): ops on it
        never share tags or sequence numbers with the caller's on parent.
        Every member calls it, in the same order relative to other groups
        made from parent."""
        if isinstance(parent, Group):
            store, ranks, rank, pname = parent._base, parent.ranks, parent.rank, parent.name
            backend = backend or parent.backend
        else:
            store = dist.distributed_c10d._get_default_store()
            ranks, rank = dist.get_process_group_ranks(parent), dist.get_rank(parent)
            pname, backend = parent.group_name, backend or str(dist.get_backend(parent))
            if backend not in ("gloo", "nccl") and hasattr(parent, "inner_backend"):
                backend = parent.inner_backend()  # a pz group: a Communicator over it runs on its inner backend
        return _made_from(cls, store, rank, ranks, backend, timeout, pname)

    def sub(self, members: List[int], backend: str) -> "Group":
        """A group of some of this group's ranks (only they call it)."""
        name = f"{self.name}/{'-'.join(map(str, members))}"
        return _made_from(Group, self._base, members.index(self.rank), [self.ranks[m] for m in members], backend,
                          self.timeout, name)

    def global_rank(self, r: int) -> int:
        return self.ranks[r]

    # --- torch's own collectives, on this group (group ranks) --------------------
    def send_recv(self, ops) -> list:
        """Post (is_send, tensor, peer) transfers. On NCCL they go as one
        batch, a lone one too (a group call, as torch's batch_isend_irecv
        makes): one work."""
        if self.backend == "nccl":
            self.pg._start_coalescing(self.device)
            for send, t, peer in ops:
                (self.pg.send if send else self.pg.recv)([t], peer, 0)
            return [self.pg._end_coalescing(self.device)]
        return [(self.pg.send if send else self.pg.recv)([t], peer, 0) for send, t, peer in ops]

    def all_reduce(self, t: torch.Tensor, op):
        return self.pg.allreduce([t], _cached(dist.AllreduceOptions, reduceOp=op))

    def broadcast(self, t: torch.Tensor, src: int):
        return self.pg.broadcast([t], _cached(dist.BroadcastOptions, rootRank=src, rootTensor=0))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor):
        return self.pg._allgather_base(out, inp)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op):
        return self.pg._reduce_scatter_base(out, inp, _cached(dist.ReduceScatterOptions, reduceOp=op))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits):
        return self.pg.alltoall_base(out, inp, list(out_splits), list(in_splits), dist.AllToAllOptions())

    def close(self) -> None:
        """Release the backend's threads and sockets (NCCL: its communicators)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # already broken by a dead peer: nothing left to release cleanly


def _made_from(cls, store, rank, ranks, backend, timeout, pname) -> Group:
    with _made_lock:
        _made[pname] += 1
        name = f"{pname}:pz{_made[pname]}"
    try:
        return cls(store, rank, ranks, backend, timeout, name)
    except RuntimeError as e:  # the store's wait (DistStoreError) when a member never constructs
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            raise PeerTimeout(f"a peer did not construct its Communicator within {timeout:g} s") from e
        raise


def _run_secret(store, rank: int, timeout: float) -> bytes:
    """16 random bytes drawn by the group's rank 0 and read by the others:
    this run's group name and the key of what its ranks check in each
    other's records and messages (docs/TRANSPORT.md, threat model)."""
    if rank == 0:
        secret = os.urandom(16)
        store.set("secret", secret)
        return secret
    store.wait(["secret"], datetime.timedelta(seconds=timeout))
    secret = store.get("secret")
    if len(secret) != 16:
        raise ValueError(f"the store key 'secret' of this group holds {len(secret)} bytes, not 16: "
                         "something else wrote it")
    return secret


def _build(store, rank: int, ranks: List[int], backend: str, timeout: float, name: str):
    """torch's own backend for these ranks, wrapped as a ProcessGroup, the way
    torch.distributed builds one (gloo: its store rendezvous happens here;
    NCCL: its communicator is made at the first op, see transports/torch.py)."""
    size, td = len(ranks), datetime.timedelta(seconds=timeout)
    pg = ProcessGroup(store, rank, size)
    if backend == "gloo":
        b = dist.ProcessGroupGloo(store, rank, size, timeout=td)
        kind, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
        if hasattr(b, "options"):  # torch >= 2.6 (its logs name the group)
            b.options.global_ranks_in_group = ranks
            b.options.group_name = name
    elif backend == "nccl":
        o = _opts(dist.ProcessGroupNCCL.Options, is_high_priority_stream=False, _timeout=td,
                  global_ranks_in_group=ranks, group_name=name)
        b = dist.ProcessGroupNCCL(store, rank, size, o)
        kind, device = ProcessGroup.BackendType.NCCL, torch.device("cuda")
    else:
        raise ValueError(f"no inner backend {backend!r}: 'gloo' (CPU) or 'nccl' (NCCL/RCCL)")
    pg._register_backend(device, kind, b)
    pg._set_default_backend(kind)
    pg._set_group_name(name)
    return pg
