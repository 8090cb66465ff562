"""The one exchange: any set of pairwise transfers, compressed or raw, over
any transport, in waves.

1. No control round: every caller (the collectives) swapped and checked its
   spec already, so each side derives the peer's messages (point to point
   announces its own: p2p.py).
2. Each direction's tensors become units (a raw tensor, or one piece of a
   coded one) cut into waves of at least wave_bytes; a wave's new coded
   pieces compress in one launch, and wave w is posted while wave w+1
   compresses.
   - A sized transport (the fabric engine) carries each coded piece as one
     message whose length its engines learn from the stream's size field:
     one post per wave.
   - Otherwise a wave posts its raw tensors and each coded piece's raw
     planes and header region (sizes follow from dtype and numel alone),
     then, once the stream sizes are read back, the coded tails.
3. Each wave decodes as soon as it is in; GPU decodes queue with no host
   sync and OR their errors into one word, checked at the end.

Streams travel flattened (ndim 1), so their layout depends on dtype and numel only."""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Dict, List, Optional

import torch

from .. import codec
from ..codec import code_of
from . import agree
from .errors import PeerError
from .pieces import Call, Plan, Result, Unit, in_wave, piece_elems, units, waves
from .transports.base import RECV, RECV_SIZED, SEND, SEND_SIZED, Transport


def exchange(tp: Transport, sends: Dict[int, object], recvs: Dict[int, object], plan, call: Call) -> Result:
    """Send sends[peer] to each peer and receive recvs[peer] from each: one
    tensor or a list (sent in order) per peer, every tensor contiguous on the
    transport's device. plan: a Plan for every pair, or {peer: Plan}."""
    x = _Exchange(tp, call)
    x.prepare(_as_lists(sends), _as_lists(recvs), plan)
    with _aborting(tp):
        return x.run()


@contextlib.contextmanager
def _aborting(tp: Transport):
    """An exchange that fails with transfers still posted must cancel them
    before its buffers are freed (the fabric engine holds raw pointers)."""
    try:
        yield
    except BaseException as e:
        tp.abort(f"an earlier exchange failed: {type(e).__name__}: {e}")
        raise


def _as_lists(d: Dict[int, object]) -> Dict[int, List[torch.Tensor]]:
    out = {}
    for p, v in d.items():
        ts = [v] if isinstance(v, torch.Tensor) else list(v)
        if ts:
            out[p] = [t.reshape(-1) for t in ts]
    return out


class _Trace:
    """PZ_TRACE=1: each exchange's host timeline (µs since its start) on stderr."""

    def __init__(self, on: bool):
        self.on = on
        self.marks: list = []
        self.t0 = time.perf_counter() if on else 0.0

    def __call__(self, what: str) -> None:
        if self.on:
            self.marks.append(f"{what} {1e6 * (time.perf_counter() - self.t0):.0f}")

    def end(self, rank: int) -> None:
        if self.on:
            self("end")
            print(f"[pz trace rank {rank}] " + " | ".join(self.marks), file=sys.stderr, flush=True)


class _Exchange:
    def __init__(self, tp: Transport, call: Call):
        self.tp, self.call = tp, call
        # For compress_batch, which takes None (not 0) for "no cap of mine": it
        # then reads this thread's sm_budget, already folded into Call.max_sms
        # on the thread that called the op, and unset on the worker.
        self.max_sms = call.max_sms or None
        self.trace = _Trace(call.settings.trace)
        self.res = Result()
        self.streams: Dict[tuple, torch.Tensor] = {}  # source key -> its stream, compressed once for every peer
        self.totals: Dict[tuple, int] = {}  # unsized transports: source key -> its stream's size, read back

    # --- round 1 and the units ---------------------------------------------
    def prepare(self, sends, recvs, plan) -> None:
        s = self.call.settings
        peers = sorted(set(sends) | set(recvs))
        pair = {p: plan if isinstance(plan, Plan) else plan[p] for p in peers}

        def coded_of(ts, p):
            return [pair[p].coded and codec.stream_layout(t)["coded"] for t in ts]

        def pieces_of(ts, coded):
            return [piece_elems(t.numel(), t.element_size(), s.piece_bytes) if c else 0 for t, c in zip(ts, coded)]

        out_coded = {p: coded_of(ts, p) for p, ts in sends.items()}
        out_piece = {p: pieces_of(ts, out_coded[p]) for p, ts in sends.items()}
        in_coded = {p: coded_of(ts, p) for p, ts in recvs.items()}
        in_piece = {p: pieces_of(ts, in_coded[p]) for p, ts in recvs.items()}
        if not all(pair[p].agreed for p in peers):
            raise ValueError("pipeline.exchange takes agreed plans only (collectives swap their spec first)")

        keys = {p: [(t.data_ptr(), t.numel(), t.dtype) for t in ts] for p, ts in sends.items()}
        self.out_units = {p: units(p, ts, out_coded[p], out_piece[p], keys[p]) for p, ts in sends.items()}
        self.in_units = {p: units(p, ts, in_coded[p], in_piece[p]) for p, ts in recvs.items()}
        self.out_waves = {p: waves(u, s.wave_bytes) for p, u in self.out_units.items()}
        self.in_waves = {p: waves(u, s.wave_bytes) for p, u in self.in_units.items()}
        self.nwaves = max([len(w) for w in self.out_waves.values()] + [len(w) for w in self.in_waves.values()] + [1])
        self.sources = {u.key: u.t for us in self.out_units.values() for u in us if u.coded}
        self.res.raw_bytes = sum(t.nbytes for ts in sends.values() for t in ts)

    # --- rounds 2 and 3 ----------------------------------------------------
    def run(self) -> Result:
        tp, dl = self.tp, self.call.deadline
        posted, sizes = [], []
        slots = (_host_slots(8 * len(self.sources))
                 if self.tp.device.type == "cuda" and self.sources and not tp.sized else None)
        n_streams = 0
        for w in range(self.nwaves):
            wave_out, wave_in = in_wave(self.out_waves, w), in_wave(self.in_waves, w)
            new, bufs = self._compress(wave_out)
            self.trace(f"wave {w} compress launched")
            if not tp.sized:  # the sizes come back in one copy, without waiting for later GPU work
                sizes.append((new, _SizesLater(bufs, slots[8 * n_streams:] if slots is not None else None)))
                n_streams += len(new)
            self._receive_buffers([u for u in wave_in if u.coded])
            posted.append(tp.post(self._first_ops(wave_out, wave_in)))
            self.trace(f"wave {w} posted")
        if not tp.sized:
            posted = [self._post_tails(w, posted[w], *sizes[w]) for w in range(self.nwaves)]
        err = torch.zeros(1, dtype=torch.int32, device=tp.device) if tp.device.type == "cuda" and self.in_units \
            else None
        seen = set()
        for w in range(self.nwaves):
            lens = tp.wait(posted[w], dl)
            self.trace(f"wave {w} done")
            wave_in = [u for u in in_wave(self.in_waves, w) if u.coded]
            if tp.sized:
                self._account_sized(in_wave(self.out_waves, w), in_wave(self.in_waves, w), lens, seen)
                wave_in = self._read_headers(wave_in)
                for u in wave_in:
                    if u.total != u.got:
                        raise PeerError(f"rank {u.peer} sent a {u.got}-byte stream whose header says {u.total} bytes")
                    self.res.streams.append((u.t.dtype, u.t.numel(), u.got))
            self._decode(wave_in, err)
        if err is not None:
            bits = int(err.item())
            self.trace("decoded")
            if bits:
                raise PeerError(f"a peer sent a corrupt stream: {codec.decode_error_text(bits)}")
        self.trace.end(tp.rank)
        return self.res

    def _first_ops(self, wave_out: List[Unit], wave_in: List[Unit]) -> list:
        """A sized transport: whole streams and raw tensors. Otherwise: raw
        tensors, and each stream's raw planes and header region."""
        ops = []
        for u in wave_out:
            if not u.coded:
                ops.append((SEND, u.t, u.peer))
                self.res.wire_bytes += u.t.nbytes
            elif self.tp.sized:
                u.buf = self.streams[u.key]
                ops.append((SEND_SIZED, u.buf, u.peer))
            else:
                u.buf, u.lay = self.streams[u.key], codec.stream_layout(u.t)
                ops += [(SEND, u.buf[u.lay["raw_begin"]: u.lay["raw_end"]], u.peer),
                        (SEND, u.buf[: u.lay["raw_begin"]], u.peer)]
        for u in wave_in:
            if not u.coded:
                ops.append((RECV, u.t, u.peer))
            elif self.tp.sized:
                ops.append((RECV_SIZED, u.buf, u.peer))
            else:
                ops += [(RECV, u.buf[u.lay["raw_begin"]: u.lay["raw_end"]], u.peer),
                        (RECV, u.buf[: u.lay["raw_begin"]], u.peer)]
        return ops

    def _post_tails(self, w: int, fixed, new: list, later: "_SizesLater"):
        """Unsized transports, once wave w's fixed parts are in: the coded tails, sized by the headers."""
        self.tp.wait(fixed, self.call.deadline)
        self.trace(f"wave {w} fixed done")
        for key, total in zip(new, later.get()):
            self.totals[key] = total
            self.res.streams.append((self.sources[key].dtype, self.sources[key].numel(), total))
        self.trace(f"wave {w} sizes read")
        ops = []
        for u in in_wave(self.out_waves, w):
            if u.coded:
                u.total = self.totals[u.key]  # compressed in this wave or an earlier one
                ops.append((SEND, u.buf[u.lay["raw_end"]: u.total], u.peer))
                self.res.wire_bytes += u.total
        for u in self._read_headers([u for u in in_wave(self.in_waves, w) if u.coded]):
            ops.append((RECV, u.buf[u.lay["raw_end"]: u.total], u.peer))
            self.res.streams.append((u.t.dtype, u.t.numel(), u.total))
        pending = self.tp.post(ops)
        self.trace(f"wave {w} tails posted")
        return pending

    def _account_sized(self, wave_out, wave_in, lens, seen) -> None:
        for u, n in zip(wave_out, lens):
            if u.coded:
                self.res.wire_bytes += n
                if u.key not in seen:
                    seen.add(u.key)
                    self.res.streams.append((u.t.dtype, u.t.numel(), n))
        for u, n in zip(wave_in, lens[len(wave_out):]):
            u.got = n

    def _compress(self, wave_out: List[Unit]):
        """Launch the compress of a wave's coded sources not yet compressed
        (once for every peer); returns their keys and streams."""
        new = list(dict.fromkeys(u.key for u in wave_out if u.coded and u.key not in self.streams))
        if len(new) == 1:
            bufs = [codec.compress_padded(self.sources[new[0]], max_sms=self.call.max_sms)]
        else:
            bufs = codec.compress_batch([self.sources[k] for k in new], trim=False,
                                        max_sms=self.max_sms) if new else []
        self.streams.update(zip(new, bufs))
        return new, bufs

    def _receive_buffers(self, us: List[Unit]) -> None:
        """One allocation for a wave's incoming streams, each 16-byte aligned (the decoder's need)."""
        if not us:
            return
        caps = []
        for u in us:
            u.lay = codec.stream_layout(u.t)
            caps.append(-(-u.lay["max_total"] // 16) * 16)
        flat = torch.empty(sum(caps), dtype=torch.uint8, device=self.tp.device)
        at = 0
        for u, cap in zip(us, caps):
            u.buf = flat[at: at + u.lay["max_total"]]
            at += cap

    @staticmethod
    def _read_headers(us: List[Unit]) -> List[Unit]:
        """Parse the header regions of a wave's incoming streams (one device-to-host
        copy); a header that is unreadable or disagrees with the control message raises."""
        if not us:
            return us
        regions = [u.buf[: u.lay["raw_begin"]] for u in us]
        heads = (regions[0] if len(regions) == 1 else torch.cat(regions)).cpu().numpy().tobytes()
        at = 0
        for u in us:
            head = heads[at: at + u.lay["raw_begin"]]
            at += u.lay["raw_begin"]
            try:
                info = codec.parse_header(head, u.lay["max_total"])
            except codec.FormatError as e:
                raise PeerError(f"rank {u.peer} sent an unreadable stream header: {e}") from e
            if info["dtype"] != code_of(u.t.dtype) or info["numel"] != u.t.numel():
                raise PeerError(f"rank {u.peer} sent a stream of {agree.describe(info['dtype'], info['numel'])} "
                                f"where {agree.describe(code_of(u.t.dtype), u.t.numel())} was announced")
            u.head, u.total = (head, info), info["total_bytes"]
        return us

    def _decode(self, us: List[Unit], err: Optional[torch.Tensor]) -> None:
        for u in us:
            stream = u.buf[: u.total]
            if err is None:
                try:
                    codec.decompress(stream, out=u.t)
                except codec.FormatError as e:
                    raise PeerError(f"rank {u.peer} sent a corrupt stream: {e}") from e
            else:
                codec.decode_queued(stream, *u.head, u.t, err, self.call.max_sms)


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
    """Streams' total sizes, read back in one copy without waiting for later
    GPU work: the codec names each stream's size field (codec.size_field)."""

    def __init__(self, bufs: List[torch.Tensor], host: Optional[torch.Tensor] = None):
        self.bufs = bufs
        if bufs and bufs[0].is_cuda:
            self.host = host[: 8 * len(bufs)]
            fields = [codec.size_field(b) for b in bufs]
            self.host.copy_(fields[0] if len(fields) == 1 else torch.cat(fields), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def get(self) -> List[int]:
        if not self.bufs or not self.bufs[0].is_cuda:
            return [codec.compressed_size(b) for b in self.bufs]
        self.event.synchronize()
        return self.host.view(torch.int64).tolist()
