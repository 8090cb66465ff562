"""The pz backend's thin native path: an op that auto sends native, with
nothing of pz's queued before it, is torch's own op. It goes from the backend
to the Communicator's group with torch's own arguments, past the full path's
stand-ins and closures, so the backend costs what torch's call costs plus a
few checks (bench/backend_overhead.py). Each function here takes the op's
arguments as torch hands them and returns its Work, or None where the op is
not one the thin path takes (the full path runs)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import REDUCIBLE

_R = dist.ReduceOp.RedOpType
# Those the full path's native plan also hands the inner backend as they are
# (AVG included: FSDP2 reduce-scatters bf16 and fp32 gradients with it).
_REDUCTIONS = frozenset((_R.SUM, _R.AVG, _R.MIN, _R.MAX))


def kind(opts):
    """torch's reduction of opts, as a RedOpType."""
    r = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    return getattr(r, "op", r)


def dense(t) -> bool:
    """A tensor pz serves: strided, any layout (a contiguous stand-in moves;
    ranks may lay out the same tensor differently, and what is served must
    not depend on it), its memory holding its values."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_conj() and not t.is_neg()
            and t.device.type in ("cpu", "cuda"))


def _flat(t) -> bool:
    """A tensor torch's own op takes as it is: one pz serves, contiguous."""
    return dense(t) and t.is_contiguous()


def _apart(out, inp, own: int = -1) -> bool:
    """Two flat tensors of one dtype in different storages, or (own >= 0) inp
    exactly out's slot own, as FSDP2's in-place all-gather has it (any other
    overlap takes the full path)."""
    if not (_flat(out) and _flat(inp) and out.dtype == inp.dtype):
        return False
    if out.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr():
        return True
    return own >= 0 and inp.data_ptr() == out.data_ptr() + own * inp.nbytes


def all_reduce(pg, tensors, opts=None):
    if opts is None or len(tensors) != 1 or kind(opts) not in _REDUCTIONS:
        return None
    t = tensors[0]
    if not _flat(t) or t.dtype not in REDUCIBLE:
        return None
    w = pg.world
    return pg.post_thin("all_reduce", t, 2 * t.nbytes * (w - 1) // w, lambda inner: inner.allreduce(tensors, opts),
                        tensors)


def broadcast(pg, tensors, opts=None):
    if opts is None or len(tensors) != 1 or not _flat(tensors[0]):
        return None
    t = tensors[0]
    sent = t.nbytes * (pg.world - 1) if opts.rootRank == pg.me else 0
    return pg.post_thin("broadcast", t, sent, lambda inner: inner.broadcast(tensors, opts), tensors)


def all_gather(name: str):
    """all_gather_into_tensor, as the inner backend's op `name` (torch 2.13 renamed it)."""
    def op(pg, out, inp, opts=None):
        if opts is None or not _apart(out, inp, pg.me) or out.numel() != pg.world * inp.numel():
            return None
        return pg.post_thin("all_gather", inp, inp.nbytes * (pg.world - 1),
                            lambda inner: getattr(inner, name)(out, inp, opts), [out], [inp])
    return op


def reduce_scatter(name: str):
    """reduce_scatter_tensor, as the inner backend's op `name`."""
    def op(pg, out, inp, opts=None):
        if (opts is None or kind(opts) not in _REDUCTIONS or not _apart(out, inp) or inp.dtype not in REDUCIBLE
                or inp.numel() != pg.world * out.numel()):
            return None
        return pg.post_thin("reduce_scatter", inp, out.nbytes * (pg.world - 1),
                            lambda inner: getattr(inner, name)(out, inp, opts), [out], [inp])
    return op
