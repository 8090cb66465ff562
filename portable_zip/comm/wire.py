"""The wire protocol: any set of pairwise transfers, compressed or raw, over a
transport, in three rounds.

1. Control: one int64[12] message each way per peer pair, naming how many
   tensors each side sends and expects and the first of each (dtype, numel,
   plan, piece size); a second message carries the rest when a pair moves
   several. Both sides compare both directions, so a mismatch raises the
   same clear error on both.
2. Fixed-size parts: raw tensors whole; for compressed ones the raw planes
   (final as soon as the split is done) and the header region. Sizes follow
   from dtype and numel alone, so receivers post them without guessing.
3. Variable-size parts: the coded tail of each stream, whose length the
   receiver read from the header it got in round 2.

Large compressed tensors travel as pieces, and each direction's sequence of
tensors and pieces is cut into waves of at least WAVE_BYTES: rounds 2 and 3
run one group per wave, so compress, wire and decompress of successive waves
overlap, and a batch of many small tensors costs three round trips, not three
per tensor. A wave's pieces compress in one launch (compress_batch).

Streams travel flattened (ndim 1), so their layout depends on dtype and numel only.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .. import _C, codec
from .._dtypes import code_of
from .errors import MismatchError, PeerError
from .transport import Transport

PROTO = 0x505A4331  # "PZC1": a send/recv control message
SPEC_PROTO = 0x505A4353  # "PZCS": a collective's (or the constructor's) spec message; same length
CHECK_PROTO = 0x505A434B  # "PZCK": a send/recv group's plan check (PZ_CHECK_PLANS); same length
WIRE_VERSION = 1 + (_C.format_version << 8)  # protocol 1 carrying stream format N
PLAN_RAW, PLAN_CODED = 1, 2
PIECE_MIN_BYTES, PIECE_MAX_BYTES = 16 << 20, 128 << 20
PIECE_ALIGN = 8192  # elements: whole fp8 pairs and whole 8-symbol vector chunks
WAVE_BYTES = 32 << 20  # each wave costs ~0.2-0.5 ms of host work (PZ_TRACE): few, large waves
CTRL_WORDS = 12
_marks: list = []  # the current exchange's start time, then its steps


@dataclass(frozen=True)
class Plan:
    """How one peer pair's transfers move. coded: compress what can be.
    agreed: both sides derived each other's specs already (a collective's spec
    swap, or a pair both sides run raw by the same rule), so the control
    round is skipped for the pair and each side derives the peer's messages."""
    coded: bool
    agreed: bool = False


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


def piece_bytes(nbytes: int) -> int:
    """Bytes per pipelined piece of a compressed transfer of nbytes: large
    transfers are cut so compressing piece k+1 overlaps sending piece k (and
    decompressing overlaps receiving); few pieces, as each costs host work."""
    if nbytes <= 2 * PIECE_MIN_BYTES:
        return nbytes
    return min(PIECE_MAX_BYTES, max(PIECE_MIN_BYTES, nbytes // 4))


def piece_override() -> int:
    """PZ_PIECE_BYTES (0: unset). Collectives derive piece sizes on both sides,
    so the Communicator checks that every rank has the same value."""
    v = os.environ.get("PZ_PIECE_BYTES")
    return int(v) if v else 0


def piece_elems(numel: int, itemsize: int) -> int:
    """Elements per piece (piece_bytes, or PZ_PIECE_BYTES); the sender announces it."""
    override = os.environ.get("PZ_PIECE_BYTES")
    if not override and numel * itemsize <= 2 * PIECE_MIN_BYTES:
        return max(numel, 1)
    target = int(override) if override else piece_bytes(numel * itemsize)
    return max(target // itemsize // PIECE_ALIGN * PIECE_ALIGN, PIECE_ALIGN)  # even: fp8 pairs stay whole


def _pieces(flat: torch.Tensor, per: int) -> List[torch.Tensor]:
    return [flat[i: i + per] for i in range(0, flat.numel(), per)]


_pinned = threading.local()


def _host_slots(nbytes: int) -> torch.Tensor:
    """This thread's pinned buffer for size read-backs, grown as needed: a pinned
    allocation per wave costs more than the wave's other host work. Exchanges on
    one thread run one at a time and read every slot before they return."""
    buf = getattr(_pinned, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _pinned.buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
    return buf


class _SizesLater:
    """Streams' total sizes, read back in one copy without waiting for later GPU work."""

    def __init__(self, bufs: List[torch.Tensor], host: Optional[torch.Tensor] = None):
        self.bufs = bufs
        if bufs and bufs[0].is_cuda:
            self.host = host[: 8 * len(bufs)]
            src = bufs[0][8:16] if len(bufs) == 1 else torch.cat([b[8:16] for b in bufs])
            self.host.copy_(src, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def get(self) -> List[int]:
        if not self.bufs or not self.bufs[0].is_cuda:
            return [codec.compressed_size(b) for b in self.bufs]
        self.event.synchronize()
        return self.host.view(torch.int64).tolist()


@dataclass
class _Unit:
    """One message of a direction's sequence: a whole raw tensor or one piece of a coded one."""
    peer: int
    t: torch.Tensor          # the piece: source (send) or destination (receive)
    coded: bool
    key: tuple = ()          # sends: (source tensor, piece index), compressed once for every peer
    buf: Optional[torch.Tensor] = None   # the stream (send) or the receive buffer
    lay: Optional[dict] = None
    total: int = 0
    head: Optional[tuple] = None         # receives: (header bytes, parsed header)


def _units(peer: int, tensors: List[torch.Tensor], plans: List[int], pieces: List[int], keys=None) -> List[_Unit]:
    out = []
    for i, t in enumerate(tensors):
        if plans[i] != PLAN_CODED:
            out.append(_Unit(peer, t, False))
            continue
        for k, piece in enumerate(_pieces(t, pieces[i])):
            out.append(_Unit(peer, piece, True, (keys[i], k) if keys else ()))
    return out


def _waves(units: List[_Unit]) -> List[List[_Unit]]:
    """Consecutive units in groups of at least WAVE_BYTES. Both sides of a
    direction derive the same waves from the control messages, and group w on
    every rank holds wave w of each of its directions, so no group waits on a
    later one anywhere (NCCL groups block until all their transfers are done)."""
    waves, cur, n = [], [], 0
    for u in units:
        cur.append(u)
        n += u.t.nbytes
        if n >= WAVE_BYTES:
            waves.append(cur)
            cur, n = [], 0
    return waves + ([cur] if cur else [])


def _in_wave(waves: Dict[int, List[List[_Unit]]], w: int) -> List[_Unit]:
    """Wave w's units of every peer (peers with fewer waves have none)."""
    return [u for ws in waves.values() if w < len(ws) for u in ws[w]]


def _as_lists(d: Dict[int, object]) -> Dict[int, List[torch.Tensor]]:
    out = {}
    for p, v in d.items():
        ts = [v] if isinstance(v, torch.Tensor) else list(v)
        if ts:
            out[p] = [t.reshape(-1) for t in ts]
    return out


def _spec_send(t, plan, piece):
    return [code_of(t.dtype), t.numel(), plan, piece]


def _spec_recv(t):
    return [code_of(t.dtype), t.numel()]


def exchange(tp: Transport, sends: Dict[int, object], recvs: Dict[int, object], plan,
             timeout: float) -> Result:
    """Send sends[peer] to each peer and receive recvs[peer] from each: one
    tensor or a list (sent in order) per peer, every tensor contiguous on the
    transport's device. plan: a Plan for every pair, or {peer: Plan}. Pairs
    whose plan is not agreed swap control messages first (round 1)."""
    res, sends, out_units, in_units, out_waves, in_waves, nwaves = _prepare(tp, sends, recvs, plan, timeout)
    with _aborting(tp):
        return _exchange_waves(tp, res, out_units, in_units, out_waves, in_waves, nwaves, timeout)


@contextlib.contextmanager
def _aborting(tp):
    """An exchange that fails with transfers still posted must cancel them
    before its buffers are freed: torch's works hold their tensors, the fabric
    engine does not, so it is aborted (closed) first."""
    try:
        yield
    except BaseException as e:
        abort = getattr(tp, "abort", None)
        if abort is not None:
            abort(f"an earlier exchange failed: {type(e).__name__}: {e}")
        raise


def _prepare(tp: Transport, sends, recvs, plan, timeout: float) -> tuple:
    """Round 1 where needed, then each direction's units cut into waves."""
    res = Result()
    _mark(None)
    sends, recvs = _as_lists(sends), _as_lists(recvs)
    peers = sorted(set(sends) | set(recvs))
    pair = {p: plan if isinstance(plan, Plan) else plan[p] for p in peers}

    def plans_of(ts, p):
        return [PLAN_CODED if pair[p].coded and _layout(t)["coded"] else PLAN_RAW for t in ts]

    def pieces_of(ts, plans):
        return [piece_elems(t.numel(), t.element_size()) if pl == PLAN_CODED else 0 for t, pl in zip(ts, plans)]

    out_plan = {p: plans_of(ts, p) for p, ts in sends.items()}
    out_piece = {p: pieces_of(ts, out_plan[p]) for p, ts in sends.items()}

    # Round 1: control messages (a second one when a peer pair moves more than one tensor).
    mine = {}
    for p in peers:
        ss = [_spec_send(t, pl, pc) for t, pl, pc in zip(sends.get(p, []), out_plan.get(p, []), out_piece.get(p, []))]
        rs = [_spec_recv(t) for t in recvs.get(p, [])]
        mine[p] = (ss, rs)
    in_plan = {p: plans_of(ts, p) for p, ts in recvs.items() if pair[p].agreed}
    in_piece = {p: pieces_of(ts, in_plan[p]) for p, ts in recvs.items() if pair[p].agreed}
    talk = [p for p in peers if not pair[p].agreed]
    if talk:
        theirs = _swap_control(tp, talk, mine, timeout)
        _mark("control swapped")
        plans, pieces = _check_control(tp.rank, talk, mine, theirs)
        in_plan.update((p, v) for p, v in plans.items() if p in recvs)
        in_piece.update((p, v) for p, v in pieces.items() if p in recvs)

    # Each direction's message sequence, cut into waves.
    keys = {p: [(t.data_ptr(), t.numel(), t.dtype) for t in ts] for p, ts in sends.items()}
    out_units = {p: _units(p, ts, out_plan[p], out_piece[p], keys[p]) for p, ts in sends.items()}
    in_units = {p: _units(p, ts, in_plan[p], in_piece[p]) for p, ts in recvs.items()}
    out_waves = {p: _waves(u) for p, u in out_units.items()}
    in_waves = {p: _waves(u) for p, u in in_units.items()}
    nwaves = max([len(w) for w in out_waves.values()] + [len(w) for w in in_waves.values()] + [1])
    for p, ts in sends.items():
        res.raw_bytes += sum(t.nbytes for t in ts)
    return res, sends, out_units, in_units, out_waves, in_waves, nwaves


def _exchange_waves(tp, res, out_units, in_units, out_waves, in_waves, nwaves, timeout) -> Result:
    dev = tp.device
    # Round 2, one group per wave: raw tensors, and each coded piece's raw
    # planes and header region, posted right after the wave's compress is
    # launched, so the wire moves wave w while wave w+1 compresses.
    streams: Dict[tuple, torch.Tensor] = {}
    sources = {key: t for p in out_units for key, t in
               ((u.key, u.t) for u in out_units[p] if u.coded)}
    sizes, fixed = [], []
    n_streams = 0
    slots = _host_slots(8 * len(sources)) if dev.type == "cuda" and sources else None
    for w in range(nwaves):
        ops = []
        wave_out = _in_wave(out_waves, w)
        new, bufs = _compress_wave(wave_out, streams, sources)
        _mark(f"wave {w} compress launched")
        sizes.append((new, _SizesLater(bufs, slots[8 * n_streams:] if slots is not None else None)))
        n_streams += len(new)
        for u in wave_out:
            if u.coded:
                u.buf, u.lay = streams[u.key], _layout(u.t)
                ops += [("send", u.buf[u.lay["raw_begin"]: u.lay["raw_end"]], u.peer),
                        ("send", u.buf[: u.lay["raw_begin"]], u.peer)]
            else:
                ops.append(("send", u.t, u.peer))
                res.wire_bytes += u.t.nbytes
        wave_in = _in_wave(in_waves, w)
        _receive_buffers([u for u in wave_in if u.coded], dev)
        for u in wave_in:
            if u.coded:
                ops += [("recv", u.buf[u.lay["raw_begin"]: u.lay["raw_end"]], u.peer),
                        ("recv", u.buf[: u.lay["raw_begin"]], u.peer)]
            else:
                ops.append(("recv", u.t, u.peer))
        fixed.append(tp.post(ops))
        _mark(f"wave {w} fixed posted")

    # Round 3, one group per wave: coded tails, sized by the headers.
    totals: Dict[tuple, int] = {}
    tails = []
    for w in range(nwaves):
        tp.wait(fixed[w], timeout)
        _mark(f"wave {w} fixed done")
        new, later = sizes[w]
        got_sizes = later.get()
        _mark(f"wave {w} sizes read")
        for key, total in zip(new, got_sizes):
            totals[key] = total
            res.streams.append((sources[key].dtype, sources[key].numel(), total))
        ops = []
        for u in _in_wave(out_waves, w):
            if u.coded:
                u.total = totals[u.key]
                ops.append(("send", u.buf[u.lay["raw_end"]: u.total], u.peer))
                res.wire_bytes += u.total
        for u in _read_headers([u for u in _in_wave(in_waves, w) if u.coded]):
            ops.append(("recv", u.buf[u.lay["raw_end"]: u.total], u.peer))
            res.streams.append((u.t.dtype, u.t.numel(), u.total))
        tails.append(tp.post(ops))
        _mark(f"wave {w} tails posted")

    # Decode each wave as soon as its tails are in; later tails keep arriving.
    err = _error_word(dev, in_units)
    for w in range(nwaves):
        tp.wait(tails[w], timeout)
        _mark(f"wave {w} tails done")
        _decode([u for u in _in_wave(in_waves, w) if u.coded], err)
    _check_error_word(err)
    _mark("end", tp.rank)
    return res


def _error_word(dev: torch.device, in_units) -> Optional[torch.Tensor]:
    """GPU decodes queue without a host sync and OR their errors into one word, checked at the end."""
    return torch.zeros(1, dtype=torch.int32, device=dev) if dev.type == "cuda" and in_units else None


def _decode(units: List[_Unit], err: Optional[torch.Tensor]) -> None:
    for u in units:
        stream = u.buf[: u.total]
        if err is None:
            try:
                codec.decompress(stream, out=u.t)
            except codec.FormatError as e:
                raise PeerError(f"rank {u.peer} sent a corrupt stream: {e}") from e
        else:
            codec._decode_gpu(stream, *u.head, u.t, err)


def _check_error_word(err: Optional[torch.Tensor]) -> None:
    if err is not None:
        bits = int(err.item())
        _mark("decoded")
        if bits:
            raise PeerError(f"a peer sent a corrupt stream: {_C.decode_error_text(bits)}")


def _compress_wave(wave_out: List[_Unit], streams: Dict[tuple, torch.Tensor], sources: Dict[tuple, torch.Tensor]):
    """Launch the compress of a wave's coded sources not yet compressed (once
    for every peer); returns their keys and streams."""
    new = list(dict.fromkeys(u.key for u in wave_out if u.coded and u.key not in streams))
    if len(new) == 1:
        bufs = [codec._compress_padded(sources[new[0]])]
    else:
        bufs = codec.compress_batch([sources[k] for k in new], trim=False) if new else []
    streams.update(zip(new, bufs))
    return new, bufs


def exchange_sized(tp, sends: Dict[int, object], recvs: Dict[int, object], plan, timeout: float) -> Result:
    """exchange() for a transport whose engine moves sized messages (the
    fabric engine): each coded piece travels as one message whose length the
    sending engine reads from the stream's header on the device, and the
    receiving engine from the first chunk, so a wave is one post each way:
    no size read-back, no separate tail round. Waves still pipeline compress,
    wire and decode."""
    from .fabric import RECV, RECV_SIZED, SEND, SEND_SIZED

    res, sends, out_units, in_units, out_waves, in_waves, nwaves = _prepare(tp, sends, recvs, plan, timeout)
    dev = tp.device
    streams: Dict[tuple, torch.Tensor] = {}
    sources = {u.key: u.t for us in out_units.values() for u in us if u.coded}
    with _aborting(tp):  # a failure with waves posted cancels them before their buffers go
        posted = []
        for w in range(nwaves):
            wave_out = _in_wave(out_waves, w)
            _compress_wave(wave_out, streams, sources)
            _mark(f"wave {w} compress launched")
            ops = []
            for u in wave_out:
                if u.coded:
                    u.buf = streams[u.key]
                    ops.append((SEND_SIZED, u.buf, u.peer))
                else:
                    ops.append((SEND, u.t, u.peer))
                    res.wire_bytes += u.t.nbytes
            wave_in = _in_wave(in_waves, w)
            _receive_buffers([u for u in wave_in if u.coded], dev)
            ops += [(RECV_SIZED, u.buf, u.peer) if u.coded else (RECV, u.t, u.peer) for u in wave_in]
            posted.append((wave_out, wave_in, tp.post_raw(ops)))
            _mark(f"wave {w} posted")
        _finish_sized(tp, res, posted, in_units, timeout)
    return res


def _finish_sized(tp, res: Result, posted: list, in_units, timeout: float) -> None:
    err = _error_word(tp.device, in_units)
    seen = set()
    for wave_out, wave_in, pending in posted:
        lens = tp.wait(pending, timeout)
        _mark("wave done")
        for u, n in zip(wave_out, lens):
            if u.coded:
                res.wire_bytes += n
                if u.key not in seen:
                    seen.add(u.key)
                    res.streams.append((u.t.dtype, u.t.numel(), n))
        coded_in = [(u, n) for u, n in zip(wave_in, lens[len(wave_out):]) if u.coded]
        got = _read_headers([u for u, _ in coded_in])
        for u, n in coded_in:
            if u.total != n:
                raise PeerError(f"rank {u.peer} sent a {n}-byte stream whose header says {u.total} bytes")
            res.streams.append((u.t.dtype, u.t.numel(), n))
        _decode(got, err)
    _check_error_word(err)
    _mark("end", tp.rank)


def _mark(what: Optional[str], rank: int = -1) -> None:
    """PZ_TRACE=1: print each exchange's host timeline (µs since its start,
    what=None) to stderr, when what="end"."""
    if not os.environ.get("PZ_TRACE"):  # read each time: a forked rank sets its environment after import
        return
    now = time.perf_counter()
    if what is None:
        _marks[:] = [now]
        return
    _marks.append(f"{what} {1e6 * (now - _marks[0]):.0f}")
    if what == "end":
        print(f"[pz trace rank {rank}] " + " | ".join(_marks[1:]), file=sys.stderr, flush=True)


def _receive_buffers(units: List[_Unit], dev: torch.device) -> None:
    """One allocation for a wave's incoming streams, each 16-byte aligned (the decoder's need)."""
    if not units:
        return
    caps = []
    for u in units:
        u.lay = _layout(u.t)
        caps.append(-(-u.lay["max_total"] // 16) * 16)
    flat = torch.empty(sum(caps), dtype=torch.uint8, device=dev)
    at = 0
    for u, cap in zip(units, caps):
        u.buf = flat[at: at + u.lay["max_total"]]
        at += cap


def _read_headers(units: List[_Unit]) -> List[_Unit]:
    """Parse the header regions of a wave's incoming streams (one device-to-host
    copy); a header that is unreadable or disagrees with the control message raises."""
    if not units:
        return units
    heads = torch.cat([u.buf[: u.lay["raw_begin"]] for u in units]).cpu().numpy().tobytes()
    at = 0
    for u in units:
        head = heads[at: at + u.lay["raw_begin"]]
        at += u.lay["raw_begin"]
        try:
            info = _C.parse_header(head, u.lay["max_total"])
        except codec.FormatError as e:
            raise PeerError(f"rank {u.peer} sent an unreadable stream header: {e}") from e
        if info["dtype"] != code_of(u.t.dtype) or info["numel"] != u.t.numel():
            raise PeerError(f"rank {u.peer} sent a stream of {_describe(info['dtype'], info['numel'])} where "
                            f"{_describe(code_of(u.t.dtype), u.t.numel())} was announced")
        u.head, u.total = (head, info), info["total_bytes"]
    return units


def _swap_control(tp: Transport, peers: List[int], mine: Dict[int, tuple], timeout: float) -> Dict[int, tuple]:
    """Swap (send specs, receive specs) with each peer: a fixed first message
    with the counts and the first spec each way, then the rest where a pair
    agreed on counts above one. Returns the peers' (first message, send specs, receive specs)."""
    dev = tp.device

    def first(ss, rs):
        return [PROTO, WIRE_VERSION, len(ss), len(rs), *(ss[0] if ss else [0] * 4), *(rs[0] if rs else [0] * 2), 0, 0]

    out = {p: torch.tensor(first(*mine[p]), dtype=torch.int64, device=dev) for p in peers}
    got = {p: torch.empty(CTRL_WORDS, dtype=torch.int64, device=dev) for p in peers}
    tp.wait(tp.post([("send", out[p], p) for p in peers] + [("recv", got[p], p) for p in peers]), timeout)
    msg1 = {p: got[p].tolist() for p in peers}
    rest_out, rest_in = {}, {}
    for p in peers:
        ss, rs = mine[p]
        m = msg1[p]
        if m[0] != PROTO or m[1] != WIRE_VERSION or (m[2], m[3]) != (len(rs), len(ss)) or max(m[2], m[3]) <= 1:
            continue  # nothing more to swap (a mismatch is reported from the first messages)
        # Counts agree and one exceeds 1, so both messages are non-empty.
        rest_out[p] = torch.tensor([v for s in ss[1:] for v in s] + [v for r in rs[1:] for v in r],
                                   dtype=torch.int64, device=dev)
        rest_in[p] = torch.empty(4 * max(m[2] - 1, 0) + 2 * max(m[3] - 1, 0), dtype=torch.int64, device=dev)
    if rest_out:
        tp.wait(tp.post([("send", t, p) for p, t in rest_out.items()] + [("recv", t, p) for p, t in rest_in.items()]),
                timeout)
    theirs = {}
    for p in peers:
        m = msg1[p]
        ss = [m[4:8]] if m[2] else []
        rs = [m[8:10]] if m[3] else []
        if p in rest_in:
            v = rest_in[p].tolist()
            ns = max(m[2] - 1, 0)
            ss += [v[4 * i: 4 * i + 4] for i in range(ns)]
            rs += [v[4 * ns + 2 * i: 4 * ns + 2 * i + 2] for i in range(m[3] - 1)]
        theirs[p] = (m, ss, rs)
    return theirs


def _check_control(rank: int, peers: List[int], mine: Dict[int, tuple], theirs: Dict[int, tuple]) -> tuple:
    """Both sides run this on the same pair of messages, so both raise alike.
    Returns the peers' plans and piece sizes for what this rank receives."""
    problems, plans, pieces = [], {}, {}
    for p in peers:
        (my_ss, my_rs), (m, ss, rs) = mine[p], theirs[p]
        if m[0] in (SPEC_PROTO, CHECK_PROTO):
            problems.append(f"rank {p} is in a collective while rank {rank} is in a send/recv exchange")
            continue
        if m[0] != PROTO:
            raise PeerError(f"rank {p} sent a garbled control message (not a portable_zip peer?)")
        if m[1] != WIRE_VERSION:
            problems.append(f"version mismatch with rank {p}: it speaks wire/format version {m[1] & 0xFF}/{m[1] >> 8}, "
                            f"this rank {WIRE_VERSION & 0xFF}/{WIRE_VERSION >> 8}")
            continue
        # Their sends against my receives, then my sends against theirs.
        # (Only first specs travel when counts differ: both sides see the same.)
        for sender, receiver, snd, rcv, n_snd, n_rcv in ((p, rank, ss, my_rs, m[2], len(my_rs)),
                                                         (rank, p, my_ss, rs, len(my_ss), m[3])):
            if n_snd != n_rcv:
                problems.append(_count_problem(sender, receiver, n_snd, n_rcv, snd, rcv))
                continue
            for i, (a, b) in enumerate(zip(snd, rcv)):
                if (a[0], a[1]) != (b[0], b[1]):
                    what = f"tensor {i}: " if n_snd > 1 else ""
                    problems.append(f"size/dtype mismatch: {what}rank {sender} sends {_describe(a[0], a[1])}, "
                                    f"rank {receiver} expects {_describe(b[0], b[1])}")
        if problems:
            continue
        plans[p] = [int(s[2]) for s in ss]
        pieces[p] = [int(s[3]) for s in ss]
        for s in ss:
            if s[2] not in (PLAN_RAW, PLAN_CODED):
                raise PeerError(f"rank {p} announced an unknown plan {s[2]}")
            if s[2] == PLAN_CODED and (s[3] <= 0 or (s[3] < s[1] and s[3] % 2)):
                raise PeerError(f"rank {p} announced an invalid piece size {s[3]}")
    if problems:
        raise MismatchError("; ".join(problems))
    return plans, pieces


def _count_problem(sender, receiver, n_snd, n_rcv, snd, rcv) -> str:
    if n_snd == 1 and n_rcv == 0:
        return f"rank {sender} sends {_describe(*snd[0][:2])} but rank {receiver} has no matching receive"
    if n_snd == 0 and n_rcv == 1:
        return f"rank {receiver} expects {_describe(*rcv[0][:2])} but rank {sender} has no matching send"
    return f"rank {sender} sends {n_snd} tensors but rank {receiver} expects {n_rcv}"
