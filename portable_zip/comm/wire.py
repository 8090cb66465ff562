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

Large compressed transfers travel as pieces, one group per piece in rounds 2
and 3, so compress, wire and decompress of successive pieces overlap.

Streams travel flattened (ndim 1), so their layout depends on dtype and numel only.
"""
from __future__ import annotations

import os
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
PIECE_MIN_BYTES, PIECE_MAX_BYTES = 8 << 20, 64 << 20
PIECE_ALIGN = 8192  # elements: whole fp8 pairs and whole 8-symbol vector chunks
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


def piece_elems(numel: int, itemsize: int) -> int:
    """Elements per pipelined piece of a compressed transfer: large transfers
    are cut so compressing piece k+1 overlaps sending piece k (and
    decompressing overlaps receiving). The sender announces it."""
    nbytes = numel * itemsize
    override = os.environ.get("PZ_PIECE_BYTES")
    if override:
        target = int(override)
    elif nbytes <= 2 * PIECE_MIN_BYTES:
        return max(numel, 1)
    else:
        target = min(PIECE_MAX_BYTES, max(PIECE_MIN_BYTES, nbytes // 8))
    return max(target // itemsize // PIECE_ALIGN * PIECE_ALIGN, PIECE_ALIGN)  # even: fp8 pairs stay whole


def _pieces(flat: torch.Tensor, per: int) -> List[torch.Tensor]:
    return [flat[i: i + per] for i in range(0, flat.numel(), per)]


class _SizeLater:
    """A stream's total size, read back without waiting for later GPU work."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        if buf.is_cuda:
            self.host = torch.empty(8, dtype=torch.uint8, pin_memory=True)
            self.host.copy_(buf[8:16], non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def get(self) -> int:
        if not self.buf.is_cuda:
            return codec.compressed_size(self.buf)
        self.event.synchronize()
        return int.from_bytes(self.host.numpy().tobytes(), "little")


def exchange(tp: Transport, sends: Dict[int, torch.Tensor], recvs: Dict[int, torch.Tensor], coded: bool,
             timeout: float) -> Result:
    """Send sends[peer] to each peer and receive recvs[peer] from each, every
    tensor contiguous on the transport's device. coded: compress what can be."""
    res = Result()
    flat_sends = {p: t.reshape(-1) for p, t in sends.items()}
    flat_recvs = {p: t.reshape(-1) for p, t in recvs.items()}
    out_plan = {p: PLAN_CODED if coded and _layout(t)["coded"] else PLAN_RAW for p, t in flat_sends.items()}
    out_piece = {p: piece_elems(t.numel(), t.element_size()) if out_plan[p] == PLAN_CODED else 0
                 for p, t in flat_sends.items()}

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
                                r.numel() if r is not None else 0, out_piece.get(p, 0)],
                               dtype=torch.int64, device=dev)
        theirs[p] = torch.empty(10, dtype=torch.int64, device=dev)
    ops = [("send", mine[p], p) for p in peers] + [("recv", theirs[p], p) for p in peers]
    tp.wait(tp.post(ops), timeout)
    ctrl = {p: theirs[p].tolist() for p in peers}
    in_plan = _check_control(tp.rank, peers, {p: mine[p].tolist() for p in peers}, ctrl)

    # Pieces of every compressed transfer; each distinct tensor is compressed
    # once, piece by piece, however many peers get it.
    out_key = {p: (t.data_ptr(), t.numel(), t.dtype) for p, t in flat_sends.items() if out_plan[p] == PLAN_CODED}
    src_pieces = {key: _pieces(flat_sends[p], out_piece[p]) for p, key in out_key.items()}
    dst_pieces = {}
    for p, out in flat_recvs.items():
        if in_plan[p] == PLAN_CODED:
            per = int(ctrl[p][9])
            if per <= 0 or (per < out.numel() and per % 2):
                raise PeerError(f"rank {p} announced an invalid piece size {per}")
            dst_pieces[p] = _pieces(out, per)
    rounds = max([len(v) for v in src_pieces.values()] + [len(v) for v in dst_pieces.values()] + [1])

    # Round 2, one group per piece: raw tensors (first group), then each
    # piece's raw planes and header region, posted right after its compress
    # is launched so the transfer of piece k overlaps the compress of k+1.
    bufs: Dict[tuple, List[tuple]] = {key: [] for key in src_pieces}
    sbufs: Dict[int, List[tuple]] = {p: [] for p in dst_pieces}
    fixed = []
    for k in range(rounds):
        ops = []
        if k == 0:
            for p, t in flat_sends.items():
                res.raw_bytes += t.nbytes
                if out_plan[p] == PLAN_RAW:
                    ops.append(("send", t, p))
                    res.wire_bytes += t.nbytes
            ops += [("recv", out, p) for p, out in flat_recvs.items() if in_plan[p] == PLAN_RAW]
        for key, pieces in src_pieces.items():
            if k < len(pieces):
                buf = codec._compress_padded(pieces[k])
                bufs[key].append((buf, _layout(pieces[k]), _SizeLater(buf)))
        for p, key in out_key.items():
            if k < len(bufs[key]):
                buf, lay, _ = bufs[key][k]
                ops += [("send", buf[lay["raw_begin"]: lay["raw_end"]], p), ("send", buf[: lay["raw_begin"]], p)]
        for p, pieces in dst_pieces.items():
            if k < len(pieces):
                lay = _layout(pieces[k])
                sbuf = torch.empty(lay["max_total"], dtype=torch.uint8, device=dev)
                sbufs[p].append((sbuf, lay))
                ops += [("recv", sbuf[lay["raw_begin"]: lay["raw_end"]], p), ("recv", sbuf[: lay["raw_begin"]], p)]
        fixed.append(tp.post(ops))

    # Round 3, one group per piece: coded tails, sized by the headers.
    tails, totals, heads = [], {}, {}
    for k in range(rounds):
        tp.wait(fixed[k], timeout)
        ops = []
        for key, entries in bufs.items():
            if k < len(entries):
                totals[(key, k)] = entries[k][2].get()
                res.streams.append((key[2], src_pieces[key][k].numel(), totals[(key, k)]))
        for p, key in out_key.items():
            if k < len(bufs[key]):
                buf, lay, _ = bufs[key][k]
                ops.append(("send", buf[lay["raw_end"]: totals[(key, k)]], p))
                res.wire_bytes += totals[(key, k)]
        for p, entries in sbufs.items():
            if k < len(entries):
                sbuf, lay = entries[k]
                piece = dst_pieces[p][k]
                try:
                    head, info = _head_info(sbuf, lay)
                except codec.FormatError as e:
                    raise PeerError(f"rank {p} sent an unreadable stream header: {e}") from e
                if info["dtype"] != code_of(piece.dtype) or info["numel"] != piece.numel():
                    raise PeerError(f"rank {p} sent a stream of {_describe(info['dtype'], info['numel'])} where "
                                    f"{_describe(code_of(piece.dtype), piece.numel())} was announced")
                totals[(p, k)] = info["total_bytes"]
                heads[(p, k)] = head, info
                ops.append(("recv", sbuf[lay["raw_end"]: info["total_bytes"]], p))
                res.streams.append((piece.dtype, piece.numel(), info["total_bytes"]))
        tails.append(tp.post(ops))

    # Decode piece k as soon as its tail is in; later tails keep arriving.
    # GPU decodes queue without a host sync and check one error word at the end.
    err = torch.zeros(1, dtype=torch.int32, device=dev) if dev.type == "cuda" and sbufs else None
    for k in range(rounds):
        tp.wait(tails[k], timeout)
        for p, entries in sbufs.items():
            if k < len(entries):
                stream = entries[k][0][: totals[(p, k)]]
                if err is None:
                    try:
                        codec.decompress(stream, out=dst_pieces[p][k])
                    except codec.FormatError as e:
                        raise PeerError(f"rank {p} sent a corrupt stream: {e}") from e
                else:
                    codec._decode_gpu(stream, *heads[(p, k)], dst_pieces[p][k], err)
    if err is not None:
        bits = int(err.item())
        if bits:
            raise PeerError(f"a peer sent a corrupt stream: {_C.decode_error_text(bits)}")
    return res


def _head_info(sbuf: torch.Tensor, lay: dict) -> tuple:
    head = bytes(sbuf[: lay["raw_begin"]].cpu().numpy().tobytes())
    return head, _C.parse_header(head, lay["max_total"])


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
