"""Collective algorithms over the one exchange (pipeline.exchange),
compressed or raw.

Reductions are two-shot and deterministic: shard j is reduced by rank j alone,
in rank order, then distributed as bytes, so every rank ends bit-identical.
coded(peer) says whether the pair with peer compresses (in a mixed cluster
only pairs in different domains do)."""
from __future__ import annotations

import enum
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import native
from .pieces import Call, Plan, Result
from .pipeline import exchange
from .transports.base import Transport

Coded = Callable[[int], bool]


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"

    @classmethod
    def of(cls, op) -> "ReduceOp":
        if isinstance(op, cls):
            return op
        name = getattr(op, "name", None) or str(op).split(".")[-1]
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unsupported reduction op {op!r}: use SUM, AVG, MIN or MAX") from None

    def native(self):
        return _NATIVE_OPS[self]

    @classmethod
    def of_torch(cls, kind) -> "Optional[ReduceOp]":
        """Ours for torch's RedOpType (SUM, AVG, MIN, MAX); None for the rest."""
        return _OF_TORCH.get(kind)


_NATIVE_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.AVG,
               ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX}
_R = dist.ReduceOp.RedOpType
_OF_TORCH = {_R.SUM: ReduceOp.SUM, _R.AVG: ReduceOp.AVG, _R.MIN: ReduceOp.MIN, _R.MAX: ReduceOp.MAX}
# The dtypes pz reduces (others: torch's own op, or a TypeError where there is none).
REDUCIBLE = frozenset((torch.bfloat16, torch.float16, torch.float32, torch.float64))


def reduction(op, dtype: torch.dtype, where: str) -> Tuple[ReduceOp, Optional[float]]:
    """pz's reduction for torch's op on dtype, and PREMUL_SUM's factor (else
    None); an op or dtype pz cannot reduce raises, naming both (the hooks')."""
    kind = getattr(op, "op", op)  # a dist.ReduceOp object (PREMUL_SUM carries its factor) or a RedOpType
    name = getattr(kind, "name", str(kind))
    if dtype not in REDUCIBLE:
        raise TypeError(f"{where}: cannot reduce {dtype} with {name}: pz reduces bfloat16, float16, float32 "
                        "and float64 tensors")
    if kind == _R.PREMUL_SUM:
        f = op.factor
        return ReduceOp.SUM, f.item() if isinstance(f, torch.Tensor) else float(f)
    ours = ReduceOp.of_torch(kind)
    if ours is None:
        raise ValueError(f"{where}: reduction op {name} is not supported for {dtype}: pz serves SUM, AVG, MIN, "
                         "MAX and PREMUL_SUM")
    return ours, None


def premultiplied(t: torch.Tensor, factor: float) -> torch.Tensor:
    """t * factor as NCCL's PreMulSum computes it: the factor rounded to t's
    dtype (as torch hands it to NCCL), then one correctly rounded product
    (torch computes 16-bit products in fp32, where they are exact)."""
    return t * float(torch.tensor(factor, dtype=torch.float64).to(t.dtype))


def even_bounds(numel: int, parts: int) -> List[tuple]:
    """Contiguous shards as even as possible, the first numel % parts one longer."""
    base, extra = divmod(numel, parts)
    out, start = [], 0
    for j in range(parts):
        end = start + base + (j < extra)
        out.append((start, end))
        start = end
    return out


def reduce_local(chunks: Sequence[torch.Tensor], op: ReduceOp, divisor: Optional[int] = None) -> torch.Tensor:
    """Reduce in rank order, accumulating 16-bit floats in fp32, one rounding
    at the end. AVG divides by divisor (default: the number of chunks)."""
    dtype = chunks[0].dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    if len(chunks) == 2 and op == ReduceOp.SUM and dtype in (torch.bfloat16, torch.float16):
        return chunks[0] + chunks[1]  # torch widens to fp32, adds, rounds once: the same bits, 4x faster
    acc = chunks[0].to(wide, copy=True)
    for c in chunks[1:]:  # in place: a fresh fp32 tensor per step cost 6x the adds on CPU ranks
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc.add_(c)  # c is widened exactly, then added in fp32: the same bits as acc + c.to(wide)
        elif op == ReduceOp.MIN:
            torch.minimum(acc, c.to(wide), out=acc)
        else:
            torch.maximum(acc, c.to(wide), out=acc)
    if op == ReduceOp.AVG:
        # A tensor divisor: CUDA divides by a Python scalar as a multiply by its
        # reciprocal, which can round differently from the CPU's true division.
        acc.div_(acc.new_full((1,), float(divisor or len(chunks))))
    return acc.to(dtype)


def _plans(coded: Coded, peers) -> dict:
    return {p: Plan(bool(coded(p)), agreed=True) for p in peers}


def broadcast(tp: Transport, t, src, coded: Coded, call: Call) -> Result:
    if tp.rank == src:
        peers = [j for j in range(tp.world) if j != src]
        return exchange(tp, {j: t for j in peers}, {}, _plans(coded, peers), call)
    return exchange(tp, {}, {src: t}, _plans(coded, [src]), call)


def all_gather(tp: Transport, out, inp, coded: Coded, call: Call) -> Result:
    chunks = out.reshape(-1).chunk(tp.world) if inp.numel() else [out.reshape(-1)[:0]] * tp.world
    chunks[tp.rank].copy_(inp.reshape(-1))
    peers = [j for j in range(tp.world) if j != tp.rank]
    return exchange(tp, {j: inp for j in peers}, {j: chunks[j] for j in peers}, _plans(coded, peers), call)


def reduce_scatter(tp: Transport, out, inp, op: ReduceOp, coded: Coded, call: Call, bounds=None, ranks=None,
                   divisor=None) -> Result:
    """Two-shot's first phase among ranks (default: every rank), in their
    order: the i-th of them reduces shard i (reduce_local; AVG divides by
    divisor, default len(ranks))."""
    ranks = list(range(tp.world)) if ranks is None else ranks
    flat = inp.reshape(-1)
    bounds = dict(zip(ranks, bounds or even_bounds(flat.numel(), len(ranks))))
    me = tp.rank
    lo, hi = bounds[me]
    peers = [j for j in ranks if j != me]
    bufs = {j: torch.empty(hi - lo, dtype=inp.dtype, device=inp.device) for j in peers}
    res = exchange(tp, {j: flat[bounds[j][0]: bounds[j][1]] for j in peers}, bufs, _plans(coded, peers), call)
    parts = [flat[lo:hi] if j == me else bufs[j] for j in ranks]
    out.reshape(-1).copy_(reduce_local(parts, op, divisor))
    return res


def all_reduce(tp: Transport, t, op: ReduceOp, coded: Coded, call: Call, ranks=None, divisor=None) -> tuple:
    """Two-shot all_reduce among ranks (default: every rank): reduce_scatter,
    then every reduced shard goes to the others as bytes."""
    ranks = list(range(tp.world)) if ranks is None else ranks
    flat = t.reshape(-1)
    shards = even_bounds(flat.numel(), len(ranks))
    bounds = dict(zip(ranks, shards))
    lo, hi = bounds[tp.rank]
    mine = torch.empty(hi - lo, dtype=t.dtype, device=t.device)
    rs = reduce_scatter(tp, mine, flat, op, coded, call, shards, ranks, divisor)
    peers = [j for j in ranks if j != tp.rank]
    flat[lo:hi].copy_(mine)
    ag = exchange(tp, {j: mine for j in peers}, {j: flat[bounds[j][0]: bounds[j][1]] for j in peers},
                  _plans(coded, peers), call)
    return rs, ag


def all_to_all(tp: Transport, out, inp, out_splits, in_splits, coded: Coded, call: Call) -> Result:
    src_chunks = _split_rows(inp, in_splits)
    dst_chunks = _split_rows(out, out_splits)
    me = tp.rank
    dst_chunks[me].copy_(src_chunks[me])
    peers = [j for j in range(tp.world) if j != me]
    return exchange(tp, {j: src_chunks[j] for j in peers}, {j: dst_chunks[j] for j in peers},
                    _plans(coded, peers), call)


def hier_all_reduce(tp: Transport, t, op: ReduceOp, coded: Coded, call: Call, domains) -> tuple:
    """all_reduce across equal-sized domains (HetCCL-style), compression only
    between domains: a native reduce-scatter inside each domain leaves local
    rank l with shard l of its domain's partial sum; the ranks holding shard l
    in every domain (a column) reduce it with a compressed two-shot exchange,
    in domain order, accumulating in fp32 with one rounding; a native
    all-gather inside each domain spreads the result. Shard l's final bytes are
    computed by the same rule on every column member, so every rank of every
    vendor ends bit-identical. Needs tp.local (domains of two or more ranks)."""
    flat = t.reshape(-1)
    size = len(domains[0])
    me = tp.rank
    d_me = next(i for i, d in enumerate(domains) if me in d)
    local = domains[d_me].index(me)
    column = [d[local] for d in domains]
    n = flat.numel()
    per = -(-n // size)
    padded = flat if per * size == n else torch.cat([flat, flat.new_zeros(per * size - n)])
    shard = torch.empty(per, dtype=t.dtype, device=t.device)
    native_op = ReduceOp.SUM.native() if op == ReduceOp.AVG else op.native()
    near = tp.local
    work = near.group.reduce_scatter(shard, padded, native_op)
    near.wait_detached([work], call.deadline)  # gloo's reduce_scatter ignores wait(timeout)
    # The column's two-shot all_reduce over the fabric, in domain order.
    rs, ag = all_reduce(tp, shard, op, coded, call, ranks=column, divisor=tp.world if op == ReduceOp.AVG else None)
    near.wait([near.group.all_gather(padded, shard)], call.deadline)
    if padded.data_ptr() != flat.data_ptr():
        flat.copy_(padded[:n])
    return rs, ag


def _split_rows(t: torch.Tensor, splits: Sequence[int]) -> List[torch.Tensor]:
    return [c.reshape(-1) for c in torch.split(native.rows(t), list(splits), dim=0)]
