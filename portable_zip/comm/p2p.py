"""The one point-to-point path: every tensor sent to one peer (the
Communicator's send/recv/isend/irecv, the pz backend's, what the adapters
build on them) travels as frames the sender decides and announces.

- A message is one or more pieces (a large coded tensor is cut so piece k+1
  compresses while piece k travels). Each piece is a fixed 128-byte frame
  (dtype, element count, plan, offset, the piece's bytes) then its payload:
  the raw bytes, or the piece's compressed stream, exactly as many bytes as
  announced. A receiver needs no agreement round and no buffer sized for a
  stream it has not seen.
- Messages match the peer's receives in posting order per (source,
  destination, tag), as torch does. A message whose tag no receive awaits yet
  is staged (its announced size) until one is posted.
- The receiver answers each message with an ACK frame once it has matched
  and landed it, or says why not (dtype or size differs, corrupt stream,
  group counts differ), so a send's Work completes when the bytes are in
  place and a mismatch raises on both sides.
- Per peer, one thread sends (compress, announce, post) and one reads (frames,
  payloads, decodes, ACKs), each only while it has work: a peer that sends
  nothing is never waited on.

The wire format is in docs/COMM.md ("Point to point")."""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional

import torch

from .. import codec
from ..codec import CODE_TO_DTYPE, CODED, code_of
from . import agree
from .agree import describe
from .deadline import Deadline
from .errors import MismatchError, PeerError
from .pieces import piece_elems
from .stats import Stats
from .transports.base import RECV, SEND

MAGIC = 0x505A5033  # "PZP3": a frame of this path
FRAME_WORDS = 16
DATA, ACK = 1, 2
RAW, CODED_PLAN = 0, 1
# ACK statuses: what the receiver found.
OK, BAD_DTYPE_OR_SIZE, CORRUPT, BAD_COUNT, BAD_VERSION = 0, 1, 2, 3, 4
# Frame words.
W_MAGIC, W_VERSION, W_KIND, W_SEQ, W_TAG, W_DTYPE, W_NUMEL, W_PLAN, W_AT, W_N, W_BYTES, W_GROUP, W_STATUS, \
    W_THEIR_DTYPE, W_THEIR_NUMEL, W_LAST = range(FRAME_WORDS)
W_ARRIVAL = W_AT  # ACK: microseconds the message's payloads took to arrive (what the sender learns of the link)
W_OWN = W_BYTES   # ACK: microseconds the receiver spent on it, its first frame read to landed (0: staged, or not timed)


@dataclass(eq=False)  # by identity: ops sit in sets
class _Op:
    kind: str                 # "send" | "recv"
    t: Optional[torch.Tensor]  # flat view of the caller's tensor (None: a receive of announced size, until matched)
    peer: int
    tag: int
    group: int                # sends: this op's group's sends to peer (0: ungrouped); recvs: its group's recvs
    deadline: Deadline
    fut: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    stream: Optional[object] = None  # the caller's CUDA stream
    seq: int = -1
    t0: float = field(default_factory=time.perf_counter)
    lead: float = 0.0                # sends: seconds from the send thread taking it up to its first post
    wire: int = 0
    plan: str = "raw"
    sms: Optional[int] = None        # the SM budget of its codec launches (None: every SM)
    new: Optional[tuple] = None      # a receive of announced size: (device, most bytes it takes or None)


@dataclass
class _Staged:
    """A message that arrived before its receive: frames and payloads, as announced."""
    frames: List[list]
    payloads: List[torch.Tensor]
    arrival: float = 0.0  # seconds its payloads took to arrive


@dataclass
class _Ack:
    frame: list
    deadline: Deadline
    then: Optional[Callable[[], None]] = None  # once the peer has it (or it failed): the receive's own outcome
    op: Optional["_Op"] = None                 # that receive: it fails with the pair if the ACK never goes


class _Stop(Exception):
    """The read thread ends; what ends the pair runs after a last ACK."""


class _BadStream(Exception):
    """A payload that cannot land: the message is refused (both ranks raise), the pair goes on."""


class Closed(PeerError):
    pass


class PointToPoint:
    """Point to point between the ranks of a Transport that carries nothing
    else (its own group or engine, so its FIFOs hold only frames of this path).

    tps: (to higher ranks, to lower ranks): one transport for both, or (NCCL,
    whose pair runs both directions on one stream, in posting order) one per
    direction, so a read waiting on the peer never holds up a send to it.
    compresses(t, peer): the sender's plan for t (the mode, and under auto the policy).
    timeout: seconds an op may take. piece_bytes: PZ_PIECE_BYTES (0: the default cut).
    sent(peer, t, coded, seconds, took): told of each message the peer has landed, with the seconds its
    payloads took to arrive there (the receiver's figure, in its ACK; 0 where it sent none) and its
    whole time less any wait for the receiver (the lead to its first post, plus the receiver's own time
    from reading its first frame to landing it, from the ACK; 0 where the receiver did not time it)."""

    def __init__(self, tps: tuple, compresses: Callable[[torch.Tensor, int], bool], timeout: float,
                 piece_bytes: int = 0, max_sms: Optional[int] = None,
                 sent: Optional[Callable[[int, torch.Tensor, bool, float, float], None]] = None):
        self.tps, self.compresses, self.timeout, self.sent = tps, compresses, timeout, sent
        self.piece_bytes, self.max_sms = piece_bytes, max_sms
        tp = tps[0]
        self.stats = Stats()
        self._peers: Dict[int, _Peer] = {}
        self._lock = threading.Lock()
        self._closed: Optional[str] = None
        self.rank, self.world = tp.rank, tp.world

    # --- posting ---------------------------------------------------------------
    def isend(self, t: torch.Tensor, peer: int, tag: int = 0, group: int = 0,
              max_sms: Optional[int] = None) -> concurrent.futures.Future:
        """Post a send; its future completes once the peer's ACK says the bytes are in place.
        group: this op's group's sends to peer on tag (0: ungrouped). max_sms: the SM budget where it
        was posted (None: the path's own cap)."""
        return self._post("send", t, peer, tag, group, max_sms)

    def irecv(self, t: torch.Tensor, peer: int, tag: int = 0, group: int = 0,
              max_sms: Optional[int] = None) -> concurrent.futures.Future:
        return self._post("recv", t, peer, tag, group, max_sms)

    def irecv_new(self, device: torch.device, peer: int, tag: int = 0, group: int = 0,
                  max_sms: Optional[int] = None, max_bytes: Optional[int] = None) -> concurrent.futures.Future:
        """A receive into a new flat tensor of the dtype and size the sender's frame announces, on device;
        its future's result is that tensor. A message over max_bytes is refused (MismatchError on both)."""
        return self._post("recv", None, peer, tag, group, max_sms, new=(torch.device(device), max_bytes))

    def _post(self, kind, t, peer, tag, group, max_sms, new=None) -> concurrent.futures.Future:
        if t is not None and not t.is_contiguous():
            raise ValueError(f"pz p2p: {kind} needs a contiguous tensor")
        dev = new[0] if new is not None else t.device
        op = _Op(kind, None if t is None else t.reshape(-1), peer, int(tag), group, Deadline(self.timeout),
                 stream=torch.cuda.current_stream(dev) if dev.type == "cuda" else None,
                 sms=max_sms or self.max_sms, new=new)
        self._peer(peer).add(op)
        return op.fut

    def _peer(self, peer: int) -> "_Peer":
        with self._lock:
            if self._closed is not None:
                raise Closed(self._closed)
            p = self._peers.get(peer)
            if p is None:
                p = self._peers[peer] = _Peer(self, peer)
            return p

    def backlog(self, peer: int) -> bool:
        """Whether more sends to peer wait behind the one leaving now (their codec work overlaps its wire)."""
        p = self._peers.get(peer)
        if p is None:
            return False
        with p.cv:  # the read thread queues ACKs here too
            return any(isinstance(op, _Op) for op in p.sends)

    def coded(self, t: torch.Tensor, peer: int) -> bool:
        return t.dtype in CODED and t.numel() > 0 and bool(self.compresses(t, peer))

    def drain(self) -> None:
        """Until every op posted so far is done (their errors stay with their futures)."""
        with self._lock:
            peers = list(self._peers.values())
        for p in peers:
            for fut in p.outstanding():
                concurrent.futures.wait([fut])

    def close(self, why: str = "the Communicator was closed") -> None:
        """Fail what is still waiting and stop the threads (the transport is the caller's)."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = why
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.stop(Closed(f"pz p2p: {why}"))


class _Peer:
    """Both directions with one peer: the send thread and the read thread."""

    def __init__(self, owner: PointToPoint, peer: int):
        self.o, self.peer = owner, peer
        self.out_tp = owner.tps[0 if peer > owner.rank else 1]  # where this rank's messages to peer go
        self.in_tp = owner.tps[0 if peer < owner.rank else 1]   # where peer's messages to this rank come
        self.cv = threading.Condition()
        self.sends: Deque[_Op] = collections.deque()      # posted, not yet on the wire
        self.recvs: Deque[_Op] = collections.deque()      # posted, not yet matched
        self.unacked: Dict[int, _Op] = {}                 # on the wire, awaiting the peer's ACK
        self.staged: Dict[int, Deque[_Staged]] = collections.defaultdict(collections.deque)
        self.broken: Optional[BaseException] = None
        self.send_seq = 0
        self.out_lock = threading.Lock()  # a message's frame and payload go out back to back
        self.arrival = 0.0  # read thread: seconds the message being read has spent arriving
        self.stopped = False
        self.landing: set = set()  # receives being filled (read thread, lander), not yet ACKed
        dev = self.out_tp.device
        # A receive posted while the read thread waits on the wire, for a message already staged, lands here:
        # nothing else may come until it does (its sender waits for the ACK).
        self.lander = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"pz-p2p-land-{peer}",
            initializer=(lambda: torch.cuda.set_device(dev)) if dev.type == "cuda" else None)
        self.threads = [threading.Thread(target=self._guard, args=(fn,), daemon=True,
                                         name=f"pz-p2p-{what}-{peer}")
                        for fn, what in ((self._send_loop, "to"), (self._read_loop, "from"))]
        for th in self.threads:
            th.start()

    def add(self, op: _Op) -> None:
        with self.cv:
            if self.broken is not None:
                _settle(op.fut, self.broken)
                return
            (self.sends if op.kind == "send" else self.recvs).append(op)
            staged = self._staged_match() if op.kind == "recv" else None
            self.cv.notify_all()
        if staged is not None:
            self.lander.submit(self._guarded_land, *staged)

    def _guarded_land(self, op: _Op, st: "_Staged") -> None:
        try:
            self._land_staged(op, st)
        except BaseException as e:  # noqa: BLE001 - as on the read thread: the pair ends, every waiter raises
            self._end(e)

    def outstanding(self) -> list:
        with self.cv:
            ops = [a if isinstance(a, _Op) else a.op for a in self.sends] + list(self.recvs) + \
                list(self.unacked.values()) + list(self.landing)
            return [op.fut for op in ops if op is not None]

    def stop(self, err: BaseException) -> None:
        with self.cv:
            self.stopped = True
            self._fail_all(err)
            self.cv.notify_all()
        self.lander.shutdown(wait=False, cancel_futures=True)

    def _fail_all(self, err: BaseException) -> None:
        """Every op still waiting with this peer fails with err; later ones too (the pair's FIFOs are lost)."""
        if self.broken is None:
            self.broken = err
        ops = [a if isinstance(a, _Op) else a.op for a in self.sends] + list(self.recvs) + \
            list(self.unacked.values()) + list(self.landing)
        self.sends.clear(), self.recvs.clear(), self.unacked.clear(), self.landing.clear()
        for op in ops:
            if op is not None and not op.fut.done():
                op.fut.set_exception(err)

    def _guard(self, loop) -> None:
        try:
            dev = self.out_tp.device
            if dev.type == "cuda":  # a new thread has no current device: the engine's staging needs its context
                torch.cuda.set_device(dev)
            loop()
        except _Stop:
            pass
        except BaseException as e:  # noqa: BLE001 - a transfer error ends the pair: every waiter raises it
            self._end(e)

    def _end(self, err: BaseException) -> None:
        with self.cv:
            self._fail_all(err)
            self.cv.notify_all()

    # --- sending ---------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self.cv:
                while not self.sends and not self.stopped and self.broken is None:
                    self.cv.wait()
                if self.stopped or self.broken is not None:
                    return
                op = self.sends.popleft()
            if isinstance(op, _Ack):
                try:
                    self.out_tp.wait(self._out([op.frame]), op.deadline)
                finally:
                    if op.then is not None:
                        op.then()
            else:
                self._send(op)

    def _send(self, op: _Op) -> None:
        o, t = self.o, op.t
        started = time.perf_counter()  # (lead: set before its first frame leaves, so before any ACK of it)
        with torch.cuda.stream(op.stream) if op.stream is not None else contextlib.nullcontext():
            coded = o.coded(t, self.peer)
            op.plan = "compressed" if coded else "raw"
            per = piece_elems(t.numel(), t.element_size(), o.piece_bytes) if coded else max(t.numel(), 1)
            starts = list(range(0, t.numel(), per)) or [0]
            with self.cv:
                op.seq, self.send_seq = self.send_seq, self.send_seq + 1
                self.unacked[op.seq] = op  # before its frame leaves: the ACK may come at once
                self.cv.notify_all()  # the read thread now has an ACK to wait for
            pending = None
            for i, at in enumerate(starts):
                piece = t[at: at + per]
                payload = self._encode(piece, op.sms) if coded else _bytes(piece)
                frame = _frame(DATA, op.seq, op.tag, code_of(t.dtype), t.numel(), CODED_PLAN if coded else RAW,
                               at, piece.numel(), payload.numel(), op.group, last=i == len(starts) - 1)
                op.wire += payload.numel()  # before it leaves: the ACK (and the stats) may come at once
                wire = self._on_wire(payload)
                if i == 0:
                    op.lead = time.perf_counter() - started
                nxt = self._out([frame, wire])
                if pending is not None:
                    self.out_tp.wait(pending, op.deadline)
                pending = nxt
            self.out_tp.wait(pending, op.deadline)

    def _encode(self, piece: torch.Tensor, sms: Optional[int]) -> torch.Tensor:
        buf = codec.compress(piece, max_sms=sms, trim=False)
        n = int(codec.size_field(buf).cpu().view(torch.int64)[0])  # on a GPU: the size's read-back
        if not 0 < n <= buf.numel():
            raise RuntimeError(f"pz p2p: the codec wrote a {n}-byte stream size into a {buf.numel()}-byte buffer")
        return buf[:n]

    def _on_wire(self, b: torch.Tensor) -> torch.Tensor:
        return b if b.device.type == self.out_tp.device.type else b.to(self.out_tp.device)

    def _out(self, parts: list):
        """Post parts to the peer back to back (an ACK from the read thread never splits them); a frame's
        words become a tensor on the transport's control device."""
        ts = [torch.tensor(p, dtype=torch.int64, device=self.out_tp.ctrl_device) if isinstance(p, list) else p
              for p in parts]
        with self.out_lock:
            return self.out_tp.post([(SEND, t, self.peer) for t in ts if t.numel()])

    def _ack(self, seq: int, status: int, mine: Optional[_Op] = None, deadline: Optional[Deadline] = None,
             then: Optional[Callable[[], None]] = None, arrival: float = 0.0, own: float = 0.0):
        """Queue an ACK ahead of the data to send: the send thread waits for it, never the read thread
        (gloo's send completes once the peer reads it, and the peer's read thread may be acking too).
        then runs once the peer has it: a receive completes only when its sender has heard, so a rank
        that exits right after its recv never leaves the sender without its ACK."""
        code, numel = (code_of(mine.t.dtype), mine.t.numel()) if mine is not None and mine.t is not None else (0, 0)
        frame = _frame(ACK, seq, 0, 0, 0, 0, 0, 0, 0, 0, status=status, their=(code, numel))
        frame[W_ARRIVAL] = min(int(arrival * 1e6), 1 << 40)
        frame[W_OWN] = min(int(own * 1e6), 1 << 40)
        with self.cv:
            self.sends.appendleft(_Ack(frame, deadline or Deadline(self.o.timeout), then, mine))
            self.landing.discard(mine)
            self.cv.notify_all()

    # --- reading ---------------------------------------------------------------
    def _demand(self) -> bool:
        return bool(self.recvs or self.unacked)

    def _read_loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopped and self.broken is None and not self._demand():
                    self.cv.wait()
                if self.stopped or self.broken is not None:
                    return
                staged = self._staged_match()
                if staged is None:
                    deadline = min((op.deadline for op in list(self.recvs) + list(self.unacked.values())),
                                   key=lambda d: d.left())
            if staged is not None:
                self._land_staged(*staged)
                continue
            f = self._read_frame(deadline)
            if f[W_KIND] == ACK:
                self._acked(f)
            else:
                self._message(f, deadline)

    def _read_frame(self, deadline: Deadline) -> list:
        buf = torch.empty(FRAME_WORDS, dtype=torch.int64, device=self.in_tp.ctrl_device)
        self.in_tp.wait(self.in_tp.post([(RECV, buf, self.peer)]), deadline)
        f = buf.tolist()
        if f[W_MAGIC] != MAGIC or f[W_KIND] not in (DATA, ACK):
            raise PeerError(f"pz p2p: rank {self.peer} sent something that is not a pz point-to-point frame "
                            f"(magic {f[W_MAGIC] & 0xFFFFFFFF:#x}): it runs another protocol")
        if f[W_VERSION] != agree.WIRE_VERSION:
            err = MismatchError(f"pz p2p: version mismatch: rank {self.peer} speaks wire/format version "
                                f"{f[W_VERSION] & 0xFF}/{f[W_VERSION] >> 8}, rank {self.o.rank} "
                                f"{agree.WIRE_VERSION & 0xFF}/{agree.WIRE_VERSION >> 8}")
            if f[W_KIND] != DATA:
                raise err
            # The sender learns it from our ACK's version; the pair ends once it has.
            self._ack(f[W_SEQ], BAD_VERSION, deadline=deadline, then=lambda: self._end(err))
            raise _Stop()
        return f

    def _acked(self, f: list) -> None:
        with self.cv:
            op = self.unacked.pop(f[W_SEQ], None)
        if op is None:
            raise PeerError(f"pz p2p: rank {self.peer} acknowledged message {f[W_SEQ]}, which was never sent")
        status = f[W_STATUS]
        if status == OK:
            try:
                self.o.stats.record("send", op.plan, op.t0, op.t.nbytes, op.wire)
                if self.o.sent is not None:
                    # Its whole time, less any wait for the receiver: the lead to its first post, then the
                    # receiver's own time from reading that first frame to landing the message.
                    took = op.lead + f[W_OWN] * 1e-6 if f[W_OWN] > 0 else 0.0
                    self.o.sent(self.peer, op.t, op.plan == "compressed", f[W_ARRIVAL] * 1e-6, took)
            finally:  # the send is done whatever its judgement does
                op.fut.set_result(None)
            return
        mine = describe(code_of(op.t.dtype), op.t.numel())
        theirs = describe(f[W_THEIR_DTYPE], f[W_THEIR_NUMEL])
        if status == BAD_DTYPE_OR_SIZE:
            err = MismatchError(f"pz p2p: send/recv mismatch: rank {self.o.rank} sends {mine} to rank {self.peer}, "
                                f"which receives {theirs} (tag {op.tag})")
        elif status == BAD_COUNT:
            err = MismatchError(f"pz p2p: rank {self.o.rank} sends {op.group} tensors but rank {self.peer} expects "
                                f"{f[W_THEIR_NUMEL]} in its group")
        elif status == BAD_VERSION:
            err = MismatchError(f"pz p2p: version mismatch with rank {self.peer}")
        else:
            err = PeerError(f"pz p2p: rank {self.peer} could not decode the {mine} stream rank {self.o.rank} sent: "
                            "it arrived corrupt")
        op.fut.set_exception(err)
        if status == BAD_COUNT:  # the two sides' groups no longer line up: nothing later on this pair can
            with self.cv:
                self._fail_all(err)

    def _message(self, f: list, deadline: Deadline) -> None:
        """A DATA frame that starts a message: match it to the oldest receive of its tag, or stage it."""
        if f[W_AT] != 0:
            raise PeerError(f"pz p2p: rank {self.peer} sent a message piece at element {f[W_AT]} with no start")
        self.arrival, first = 0.0, time.perf_counter()
        with self.cv:
            # Behind staged messages of its tag it waits its turn: they are older.
            op = None if self.staged.get(f[W_TAG]) else next((r for r in self.recvs if r.tag == f[W_TAG]), None)
            if op is not None:
                self.recvs.remove(op)
                self.landing.add(op)
        if op is None:
            frames, payloads = self._take(f, deadline, into=None)
            with self.cv:
                self.staged[f[W_TAG]].append(_Staged(frames, payloads, self.arrival))
            return
        why = self._mismatch(f, op)
        if why is not None:
            self._take(f, deadline, into=None)  # keep the FIFO in step
            self._refuse(op, f, *why)
            return
        try:
            self._take(f, deadline, into=op)
        except _BadStream as e:
            self._refuse(op, f, CORRUPT, PeerError(str(e)))
            return
        self._done(op, f, self.arrival, time.perf_counter() - first)

    def _mismatch(self, f: list, op: _Op):
        """Why op cannot take message f, as (status, error); None where it can (a receive of announced
        size gets its tensor here)."""
        if op.group and f[W_GROUP] and op.group != f[W_GROUP]:
            return BAD_COUNT, MismatchError(f"pz p2p: rank {self.peer} sends {f[W_GROUP]} tensors but rank "
                                            f"{self.o.rank} expects {op.group} in its group")
        if op.t is None:
            device, most = op.new
            dtype = CODE_TO_DTYPE.get(f[W_DTYPE])
            if dtype is None or f[W_NUMEL] < 0:
                return None  # a malformed frame: the piece check ends the pair
            if most is not None and f[W_NUMEL] * dtype.itemsize > most:
                return BAD_DTYPE_OR_SIZE, MismatchError(
                    f"pz p2p: rank {self.peer} sends {describe(f[W_DTYPE], f[W_NUMEL])}, more than the {most} "
                    f"bytes rank {self.o.rank}'s receive takes (tag {op.tag})")
            op.t = torch.empty(f[W_NUMEL], dtype=dtype, device=device)
            return None
        t = op.t
        if f[W_DTYPE] != code_of(t.dtype) or f[W_NUMEL] != t.numel():
            return BAD_DTYPE_OR_SIZE, MismatchError(
                f"pz p2p: send/recv mismatch: rank {self.peer} sends {describe(f[W_DTYPE], f[W_NUMEL])}, "
                f"rank {self.o.rank} receives {describe(code_of(t.dtype), t.numel())} (tag {op.tag})")
        return None

    def _refuse(self, op: _Op, f: list, status: int, err: BaseException) -> None:
        def then():
            _settle(op.fut, err)
            if status == BAD_COUNT:  # the two sides' groups no longer line up: nothing later on this pair can
                self._end(err)
        self._ack(f[W_SEQ], status, op, op.deadline, then)

    def _done(self, op: _Op, f: list, arrival: float, own: float = 0.0) -> None:
        plan = "compressed" if f[W_PLAN] == CODED_PLAN else "raw"

        def then():
            self.o.stats.record("recv", plan, op.t0, 0, 0)
            _settle(op.fut, None, op.t if op.new is not None else None)
        self._ack(f[W_SEQ], OK, op, op.deadline, then, arrival, own)

    def _take(self, f: list, deadline: Deadline, into: Optional[_Op]):
        """Read a message's pieces from the wire: into op's tensor, or (None) into staging buffers. A piece
        that cannot land leaves the rest to be read and dropped (the FIFO stays in step), then raises."""
        frames, payloads, bad = [], [], None
        while True:
            self._check_piece(f, frames[0] if frames else f)
            if into is None or bad is not None:
                buf = self._recv_bytes(torch.empty(f[W_BYTES], dtype=torch.uint8, device=self.in_tp.device),
                                       deadline)
                if into is None:
                    payloads.append(buf)
            else:
                try:
                    self._land_piece(into, f, None, deadline)  # its payload is read before it is judged
                except _BadStream as e:
                    bad = e
            frames.append(f)
            if f[W_LAST]:
                if bad is not None:
                    raise bad
                return frames, payloads
            f = self._read_frame(deadline)
            while f[W_KIND] == ACK:  # the peer's ACKs may sit between the pieces of its message
                self._acked(f)
                f = self._read_frame(deadline)

    def _check_piece(self, f: list, first: list) -> None:
        code, numel, at, n, nbytes = f[W_DTYPE], f[W_NUMEL], f[W_AT], f[W_N], f[W_BYTES]
        dtype = CODE_TO_DTYPE.get(code)
        ok = (dtype is not None and f[W_SEQ] == first[W_SEQ] and numel == first[W_NUMEL] and 0 <= at
              and 0 <= n and at + n <= numel and f[W_PLAN] in (RAW, CODED_PLAN) and (at > 0 or f is first))
        if ok:
            itemsize = dtype.itemsize
            ok = nbytes == n * itemsize if f[W_PLAN] == RAW else 0 < nbytes <= codec.max_compressed_size(n, dtype)
        if not ok:
            raise PeerError(f"pz p2p: rank {self.peer} announced a malformed message piece "
                            f"(dtype code {code}, {numel} elements, piece {at}+{n}, {nbytes} bytes)")

    def _recv_bytes(self, buf: torch.Tensor, deadline: Deadline) -> torch.Tensor:
        """A payload, read thread only; its time counts toward the message's arrival."""
        t0 = time.perf_counter()
        self.in_tp.wait(self.in_tp.post([(RECV, buf, self.peer)]), deadline)
        self.arrival += time.perf_counter() - t0
        return buf

    def _land_piece(self, op: _Op, f: list, payload: Optional[torch.Tensor], deadline: Deadline) -> None:
        """Piece f of op's message, from the wire (payload None) or from staging."""
        dst = op.t[f[W_AT]: f[W_AT] + f[W_N]]
        with torch.cuda.stream(op.stream) if op.stream is not None else contextlib.nullcontext():
            if f[W_PLAN] == RAW:
                if payload is None and dst.device.type == self.in_tp.device.type:
                    self._recv_bytes(_bytes(dst), deadline)  # straight into place
                    return
                if payload is None:
                    payload = self._recv_bytes(torch.empty(f[W_BYTES], dtype=torch.uint8,
                                                           device=self.in_tp.device), deadline)
                _bytes(dst).copy_(payload)
                return
            if payload is None:
                payload = self._recv_bytes(torch.empty(f[W_BYTES], dtype=torch.uint8, device=self.in_tp.device),
                                           deadline)
            self._check_stream(payload, f, dst)
            src = payload if payload.device == dst.device else payload.to(dst.device)
            try:
                codec.decompress(src, out=dst, max_sms=op.sms, check=True)
            except codec.FormatError as e:
                raise _BadStream(f"pz p2p: rank {self.peer} sent a corrupt stream: {e}") from None

    def _check_stream(self, payload: torch.Tensor, f: list, dst: torch.Tensor) -> None:
        """The stream's own header agrees with its frame (read before decoding a byte)."""
        try:
            info = codec.inspect(payload)
        except codec.FormatError as e:
            raise _BadStream(f"pz p2p: rank {self.peer} sent an unreadable stream header: {e}") from None
        if info["dtype"] != dst.dtype or info["original_bytes"] != dst.nbytes \
                or info["compressed_bytes"] != f[W_BYTES]:
            raise _BadStream(f"pz p2p: rank {self.peer} sent a {info['dtype']} stream of {info['original_bytes']} "
                             f"bytes ({info['compressed_bytes']} coded) where its frame announced "
                             f"{describe(f[W_DTYPE], f[W_N])} in {f[W_BYTES]} bytes")

    def _staged_match(self):
        """The oldest receive whose tag has a staged message, with that message."""
        for op in self.recvs:
            q = self.staged.get(op.tag)
            if q:
                self.recvs.remove(op)
                self.landing.add(op)
                return op, q.popleft()
        return None

    def _land_staged(self, op: _Op, st: _Staged) -> None:
        f = st.frames[0]
        why = self._mismatch(f, op)
        if why is not None:
            self._refuse(op, f, *why)
            return
        try:
            for fr, payload in zip(st.frames, st.payloads):
                self._land_piece(op, fr, payload, op.deadline)
        except _BadStream as e:
            self._refuse(op, f, CORRUPT, PeerError(str(e)))
            return
        self._done(op, f, st.arrival)


def _settle(fut: concurrent.futures.Future, err: Optional[BaseException], value=None) -> None:
    """fut's outcome unless it has one (a failure of the pair may have come first)."""
    if fut.done():
        return
    if err is None:
        fut.set_result(value)
    else:
        fut.set_exception(err)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _frame(kind, seq, tag, code, numel, plan, at, n, nbytes, group, last=True, status=0, their=(0, 0)):
    words = [0] * FRAME_WORDS
    words[W_MAGIC], words[W_VERSION], words[W_KIND], words[W_SEQ], words[W_TAG] = \
        MAGIC, agree.WIRE_VERSION, kind, seq, tag
    words[W_DTYPE], words[W_NUMEL], words[W_PLAN], words[W_AT], words[W_N], words[W_BYTES] = \
        code, numel, plan, at, n, nbytes
    words[W_GROUP], words[W_STATUS], words[W_LAST] = group, status, int(last)
    words[W_THEIR_DTYPE], words[W_THEIR_NUMEL] = their
    return words
