"""Point to point with torch's semantics for the pz backend: each send is
matched to the peer's recv in posting order, whatever either side batches
or waits on (pipeline schedules post sends in one batch and receive them one
at a time), and a send needs nothing from the receiver but its recv.

A transfer the mode leaves uncoded (compress="never", small ones under
"auto", dtypes the codec does not code) is torch's own send/recv on the
header group. A coded one sends a header there (dtype, numel, payload
bytes: 0 means raw) and then its payload on the data group: the tensor's
bytes, or its compressed stream, as the sender's policy decided. The
receiver reads the sender's plan from the header, so no round of agreement
is needed, and posts each payload recv in its source's order once that
header is in. Two groups keep each kind of message in its own FIFO."""
from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from typing import Callable, Dict

import torch

from .. import codec
from .._dtypes import CODED, code_of
from ..comm.errors import MismatchError, PeerError
from ..comm.group import Group
from ..comm.stats import Stats
from ..comm.work import Work as PzWork
from . import works

MAGIC = 0x505A5032  # "PZP2": a header of this protocol, version 2
AUTO_NATIVE_MAX = 64 << 10  # under "auto", what is smaller moves as torch's own send/recv (one message)


class P2P:
    """One device kind's point to point. hdr, data: two groups of the same
    ranks (the inner backend's kind); wire: where payloads travel (the
    data group's device: host memory when GPU ranks have no NCCL)."""

    def __init__(self, hdr: Group, data: Group, mode: str, compress_pays: Callable[[torch.Tensor], bool],
                 max_sms: int = 0):
        self.hdr, self.data, self.mode = hdr, data, mode
        self.compress_pays, self.max_sms = compress_pays, max_sms or None
        self.wire = data.device
        self.stats = Stats()
        self._lanes: Dict[int, concurrent.futures.ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def headed(self, t: torch.Tensor) -> bool:
        """Whether t travels with a header (a function of mode, dtype and size alone: both sides agree)."""
        if self.mode == "never" or t.dtype not in CODED or t.numel() == 0:
            return False
        return self.mode == "always" or t.nbytes > AUTO_NATIVE_MAX

    def _on_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device.type == self.wire.type else t.to(self.wire)

    # --- send ------------------------------------------------------------------
    def send(self, t: torch.Tensor, peer: int):
        t0 = time.perf_counter()
        if not self.headed(t):
            self.stats.record("send", "native", t0, t.nbytes, t.nbytes)
            return works.Joined([self.hdr.pg.send([self._on_wire(t)], peer, 0)], [t])  # with a future, unlike gloo's
        coded = self.mode == "always" or self.compress_pays(t)
        flat = t.reshape(-1)
        if coded:
            buf = codec.compress(flat, max_sms=self.max_sms, trim=False)
            wire = int(codec.size_field(buf).cpu().view(torch.int64)[0])  # the stream's size (a host sync on GPU)
            payload = buf[:wire]
        else:
            wire, payload = 0, flat.view(torch.uint8)
        head = torch.tensor([MAGIC, code_of(t.dtype), t.numel(), wire], dtype=torch.int64, device=self.wire)
        ws = [self.hdr.pg.send([head], peer, 0), self.data.pg.send([self._on_wire(payload)], peer, 0)]
        self.stats.record("send", "compressed" if coded else "raw", t0, t.nbytes, wire or t.nbytes)
        return works.joined(ws, [t])

    # --- recv ------------------------------------------------------------------
    def recv(self, t: torch.Tensor, peer: int):
        t0 = time.perf_counter()
        if not self.headed(t):
            self.stats.record("recv", "native", t0, 0, 0)
            if t.device.type == self.wire.type:
                return works.Joined([self.hdr.pg.recv([t], peer, 0)], [t])
            host = torch.empty(t.shape, dtype=t.dtype, device=self.wire)
            self.hdr.pg.recv([host], peer, 0).wait()  # staged: finished here
            t.copy_(host)
            return works.done([t])
        head = torch.empty(4, dtype=torch.int64, device=self.wire)
        op = _Recv(t, peer, head, torch.cuda.current_stream(t.device) if t.is_cuda else None, t0)
        hw = self.hdr.pg.recv([head], peer, 0)
        # The source's lane waits for the header, posts the payload recv
        # and lands it: one lane per source keeps its payloads in order.
        self._lane(peer).submit(self._land, op, hw).add_done_callback(lambda f: _settle(op.done, f))
        return works.Work([PzWork(op.done)], [t])

    def _lane(self, peer: int) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            lane = self._lanes.get(peer)
            if lane is None:
                lane = self._lanes[peer] = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"pz-p2p-from-{peer}")
            return lane

    def _land(self, op, hw) -> None:
        peer, t = op.peer, op.t
        _waited(hw, f"the header from rank {peer}")
        magic, code, numel, wire = (int(v) for v in op.head.cpu())
        if magic != MAGIC:
            raise PeerError(f"pz p2p: rank {peer} sent no pz header (magic {magic:#x}): it runs another "
                            "protocol, or its sends and this rank's recvs do not match")
        if code != code_of(t.dtype) or numel != t.numel():
            theirs = next((str(d) for d in CODED if code_of(d) == code), f"dtype code {code}")
            raise MismatchError(f"pz p2p: rank {peer} sends {theirs} with {numel} elements but this "
                                f"rank receives {t.dtype} with {t.numel()}")
        if wire > codec.max_compressed_size(numel, t.dtype):
            raise PeerError(f"pz p2p: rank {peer} announced a {wire}-byte stream for {numel} elements")
        buf = torch.empty(wire or t.nbytes, dtype=torch.uint8, device=self.wire)
        _waited(self.data.pg.recv([buf], peer, 0), f"the payload from rank {peer}")
        with torch.cuda.stream(op.stream) if op.stream is not None else contextlib.nullcontext():
            src = buf.to(t.device, non_blocking=True) if buf.device != t.device else buf
            if wire:
                codec.decompress(src, out=t.reshape(-1), max_sms=self.max_sms, check=True)
            else:
                t.reshape(-1).view(torch.uint8).copy_(src)
        self.stats.record("recv", "compressed" if wire else "raw", op.t0, 0, 0)

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)


def _waited(w, what: str) -> None:
    try:
        w.wait()
    except RuntimeError as e:
        raise PeerError(f"pz p2p: {what} did not arrive: {str(e).splitlines()[0] if str(e) else e}") from None


def _settle(done: concurrent.futures.Future, lane_fut: concurrent.futures.Future) -> None:
    e = lane_fut.exception()
    if e is not None:
        done.set_exception(e)
    else:
        done.set_result(None)


class _Recv:
    def __init__(self, t, peer, head, stream, t0):
        self.t, self.peer, self.head, self.stream, self.t0 = t, peer, head, stream, t0
        self.done = concurrent.futures.Future()
