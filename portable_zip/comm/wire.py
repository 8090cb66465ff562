"""The wire protocol: any set of pairwise transfers, compressed or raw, over a
transport, in three rounds.

1. Control: one int64[10] message each way per peer pair, naming what each
   side sends (dtype, numel, plan) and what it expects. Both sides compare
   both directions, so a mismatch raises the same clear error on both.
2. Fixed-size parts: raw tensors whole; for compressed ones the raw planes
   (final as soon as the split is done) and the header region. Sizes follow
   from dtype and numel alone, so receivers post them without guessing.
3. Variable-size parts: the coded tail of each stream, whose length the
   receiver read from the header it got in round 2.

Streams travel flattened (ndim 1), so their layout depends on dtype and numel only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch

from .. import _C, codec
from .._dtypes import code_of
from .errors import MismatchError, PeerError
from .transport import Transport

PROTO = 0x505A4331  # "PZC1"
WIRE_VERSION = 1 + (_C.format_version << 8)  # protocol 1 carrying stream format N
PLAN_NONE, PLAN_RAW, PLAN_CODED = 0, 1, 2
_PLAN_NAMES = {PLAN_NONE: "nothing", PLAN_RAW: "raw", PLAN_CODED: "compressed"}


@dataclass
class Result:
    raw_bytes: int = 0    # payload bytes this rank sent, uncompressed
    wire_bytes: int = 0   # bytes this rank actually sent
    streams: List[tuple] = field(default_factory=list)  # (dtype, numel, stream bytes) of every coded stream seen


def _layout(t: torch.Tensor) -> dict:
    return _C.stream_layout(code_of(t.dtype), t.numel(), [t.numel()])


def _describe(dtype_code: int, numel: int) -> str:
    from .._dtypes import CODE_TO_DTYPE

    name = str(CODE_TO_DTYPE.get(dtype_code, f"dtype#{dtype_code}")).replace("torch.", "")
    return f"{name}[{numel}]"


def exchange(tp: Transport, sends: Dict[int, torch.Tensor], recvs: Dict[int, torch.Tensor], coded: bool,
             timeout: float) -> Result:
    """Send sends[peer] to each peer and receive recvs[peer] from each, every
    tensor contiguous on the transport's device. coded: compress what can be."""
    res = Result()
    flat_sends = {p: t.reshape(-1) for p, t in sends.items()}
    flat_recvs = {p: t.reshape(-1) for p, t in recvs.items()}

    # Compress each distinct tensor once (all_gather and broadcast send one tensor to all).
    streams: Dict[tuple, tuple] = {}
    out_plan: Dict[int, int] = {}
    for p, t in flat_sends.items():
        lay = _layout(t)
        if coded and lay["coded"]:
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key not in streams:
                streams[key] = (codec._compress_padded(t), lay)
            out_plan[p] = PLAN_CODED
        else:
            out_plan[p] = PLAN_RAW

    # Round 1: control messages.
    peers = sorted(set(flat_sends) | set(flat_recvs))
    dev = tp.device
    mine, theirs = {}, {}
    for p in peers:
        s, r = flat_sends.get(p), flat_recvs.get(p)
        mine[p] = torch.tensor([PROTO, WIRE_VERSION,
                                s is not None, code_of(s.dtype) if s is not None else 0,
                                s.numel() if s is not None else 0, out_plan.get(p, PLAN_NONE),
                                r is not None, code_of(r.dtype) if r is not None else 0,
                                r.numel() if r is not None else 0, 0], dtype=torch.int64, device=dev)
        theirs[p] = torch.empty(10, dtype=torch.int64, device=dev)
    ops = [("send", mine[p], p) for p in peers] + [("recv", theirs[p], p) for p in peers]
    tp.wait(tp.post(ops), timeout)
    in_plan = _check_control(tp.rank, peers, {p: mine[p].tolist() for p in peers},
                             {p: theirs[p].tolist() for p in peers})

    # Round 2: raw tensors, raw planes and header regions.
    ops, incoming = [], {}
    for p, t in flat_sends.items():
        res.raw_bytes += t.nbytes
        if out_plan[p] == PLAN_RAW:
            ops.append(("send", t, p))
            res.wire_bytes += t.nbytes
        else:
            buf, lay = streams[(t.data_ptr(), t.numel(), t.dtype)]
            ops += [("send", buf[lay["raw_begin"]: lay["raw_end"]], p), ("send", buf[: lay["raw_begin"]], p)]
    for p, out in flat_recvs.items():
        if in_plan[p] == PLAN_RAW:
            ops.append(("recv", out, p))
        else:
            lay = _layout(out)
            sbuf = torch.empty(lay["max_total"], dtype=torch.uint8, device=dev)
            incoming[p] = (sbuf, lay)
            ops += [("recv", sbuf[lay["raw_begin"]: lay["raw_end"]], p), ("recv", sbuf[: lay["raw_begin"]], p)]
    tp.wait(tp.post(ops), timeout)

    # Round 3: coded tails, sized by the headers.
    ops, totals = [], {}
    for (ptr, numel, dtype), (buf, lay) in streams.items():
        totals[(ptr, numel, dtype)] = total = codec.compressed_size(buf)
        res.streams.append((dtype, numel, total))
    for p, t in flat_sends.items():
        if out_plan[p] == PLAN_CODED:
            key = (t.data_ptr(), t.numel(), t.dtype)
            buf, lay = streams[key]
            ops.append(("send", buf[lay["raw_end"]: totals[key]], p))
            res.wire_bytes += totals[key]
    recv_totals = {}
    for p, (sbuf, lay) in incoming.items():
        try:
            info = _head_info(sbuf, lay)
        except codec.FormatError as e:
            raise PeerError(f"rank {p} sent an unreadable stream header: {e}") from e
        out = flat_recvs[p]
        if info["dtype"] != code_of(out.dtype) or info["numel"] != out.numel():
            raise PeerError(f"rank {p} sent a stream of {_describe(info['dtype'], info['numel'])} after announcing "
                            f"{_describe(code_of(out.dtype), out.numel())}")
        recv_totals[p] = info["total_bytes"]
        ops.append(("recv", sbuf[lay["raw_end"]: recv_totals[p]], p))
        res.streams.append((out.dtype, out.numel(), recv_totals[p]))
    tp.wait(tp.post(ops), timeout)

    for p, (sbuf, lay) in incoming.items():
        codec.decompress(sbuf[: recv_totals[p]], out=flat_recvs[p])
    return res


def _head_info(sbuf: torch.Tensor, lay: dict) -> dict:
    head = bytes(sbuf[: lay["raw_begin"]].cpu().numpy().tobytes())
    return _C.parse_header(head, lay["max_total"])


def _check_control(rank: int, peers: List[int], mine: Dict[int, list], theirs: Dict[int, list]) -> Dict[int, int]:
    """Both sides run this on the same pair of messages, so both raise alike."""
    problems, plans = [], {}
    for p in peers:
        m, t = mine[p], theirs[p]
        if t[0] != PROTO:
            raise PeerError(f"rank {p} sent a garbled control message (not a portable_zip peer?)")
        if t[1] != WIRE_VERSION:
            problems.append(f"version mismatch with rank {p}: it speaks wire/format version {t[1] & 0xFF}/{t[1] >> 8}, "
                            f"this rank {WIRE_VERSION & 0xFF}/{WIRE_VERSION >> 8}")
            continue
        # Their send vs my receive, then my send vs their receive.
        for sender, receiver, snd, rcv in ((p, rank, t[2:6], m[6:9]), (rank, p, m[2:6], t[6:9])):
            if not snd[0] and not rcv[0]:
                continue
            if snd[0] != rcv[0]:
                who, what = (sender, "sends") if snd[0] else (receiver, "expects")
                problems.append(f"rank {who} {what} {_describe(*(snd[1:3] if snd[0] else rcv[1:3]))} "
                                f"but rank {receiver if snd[0] else sender} has no matching "
                                f"{'receive' if snd[0] else 'send'}")
            elif (snd[1], snd[2]) != (rcv[1], rcv[2]):
                problems.append(f"size/dtype mismatch: rank {sender} sends {_describe(snd[1], snd[2])}, "
                                f"rank {receiver} expects {_describe(rcv[1], rcv[2])}")
        if t[2]:
            plans[p] = int(t[5])
            if plans[p] not in (PLAN_RAW, PLAN_CODED):
                raise PeerError(f"rank {p} announced an unknown plan {plans[p]}")
    if problems:
        raise MismatchError("; ".join(problems))
    return plans
