"""KVReceiver: a decode rank's side. One thread per source rank reads that
source's stream (descriptor, payload, ...), checks each payload's checksum
and scatters it into the request's own blocks; data for a request not yet
registered waits, parked, until recv() names its blocks."""
from __future__ import annotations

import collections
import threading
import time
from typing import Optional

import torch

from ..codec import delta
from ..comm import PeerError, PeerTimeout
from . import link, wire
from .errors import KVIntegrityError, KVMismatchError, KVTransferError
from .layout import CODES, DTYPES, as_layers, block_ids

_FINISHED_KEPT = 1 << 16


class RecvHandle:
    """One request's receiving: wait(layer) returns once that layer's blocks
    (wait(): every layer's) are in the cache, and raises the request's error
    (KVTransferError, KVIntegrityError, KVMismatchError) otherwise."""

    def __init__(self, request_id, src: int, num_layers: int, cv: threading.Condition):
        self.request_id, self.src, self.num_layers = request_id, src, num_layers
        self.error: Optional[BaseException] = None
        self._layers = set()
        self._cv = cv

    def done(self) -> bool:
        """Every layer arrived, or the request failed."""
        with self._cv:
            return self.error is not None or len(self._layers) == self.num_layers

    def wait(self, layer: Optional[int] = None, timeout: Optional[float] = None) -> None:
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)
                                  or not 0 <= layer < self.num_layers):
            raise ValueError(f"KV request {self.request_id!r} has layers 0..{self.num_layers - 1}, not {layer!r}")
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self.error is None and not (layer in self._layers if layer is not None
                                              else len(self._layers) == self.num_layers):
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    what = "all layers" if layer is None else f"layer {layer}"
                    raise PeerTimeout(f"KV request {self.request_id!r}: {what} not received within {timeout:g} s "
                                      "(still running, wait() again)")
                self._cv.wait(left)
            if self.error is not None:
                raise self.error


class _Request:
    def __init__(self, request_id, key, src, layers, ids, first_block, cv):
        self.id, self.key, self.src, self.layers = request_id, key, src, layers
        self.ids, self.first_block = ids, first_block  # ids per device, CPU copy under "cpu"
        self.handle = RecvHandle(request_id, src, len(layers), cv)
        self.apply = threading.Lock()  # chunks land in stream order: parked ones first


class KVReceiver:
    """Receives requests' KV blocks over comm (a pz.Communicator) from the
    sender ranks in sources, each running a KVSender that lists this rank.
    Thread-safe.

    max_parked_bytes: payloads that arrive before recv() names their request
    wait in memory up to this total; past it the request fails (its later
    recv() raises)."""

    def __init__(self, comm, sources, *, max_parked_bytes: int = 1 << 30):
        self.comm, self.rank = comm, comm.rank
        srcs = sorted(set(int(s) for s in sources))
        if not srcs or any(s == self.rank or not 0 <= s < comm.world for s in srcs):
            raise ValueError(f"sources must be other ranks of the Communicator (world {comm.world}, this rank "
                             f"{self.rank}), got {list(sources)}")
        self.max_parked_bytes = int(max_parked_bytes)
        self._cv = threading.Condition()
        self._active = {}               # request_id -> _Request
        self._keys = {}                 # (src, key) -> _Request
        self._parked = collections.defaultdict(list)  # (src, key) -> [(Descriptor, payload | error)]
        self._parked_bytes = 0
        self._failed_keys = {}          # (src, key) -> error, for requests failed before recv()
        self._finished = collections.OrderedDict()
        self._broken = {}               # src -> error
        self._closing = False
        self._threads = {s: threading.Thread(target=self._run, args=(s,), name=f"pz-kv-recv-{s}", daemon=True)
                         for s in srcs}
        for t in self._threads.values():
            t.start()

    # --- the API ------------------------------------------------------------
    def recv(self, request_id, src_rank: int, kv_caches, block_ids_, *, first_block: int = 0) -> RecvHandle:
        """Receive request_id from src_rank into kv_caches (every layer, a
        sequence or dict of per-layer caches), block_ids_[i] holding the
        request's logical block first_block + i (blocks before first_block
        are received and dropped: a local prefix hit). Returns at once.
        Raises ValueError for an id already active or finished, KeyError for
        a source this receiver does not listen to."""
        key = wire.request_key(request_id)
        if src_rank not in self._threads:
            raise KeyError(f"KV request {request_id!r}: rank {src_rank} is not a source of this receiver "
                           f"({sorted(self._threads)})")
        if isinstance(first_block, bool) or not isinstance(first_block, int) or first_block < 0:
            raise ValueError(f"first_block must be a non-negative int, got {first_block!r}")
        layers = as_layers(kv_caches)
        num = min(lay.num_blocks for lay in layers)
        ids = block_ids(block_ids_, num, f"KV request {request_id!r} block_ids", unique=True)
        per_dev = {}
        for lay in layers:
            per_dev.setdefault(lay.device, ids.to(lay.device))
        req = _Request(request_id, key, src_rank, layers, per_dev, first_block, self._cv)
        with req.apply:
            with self._cv:
                if self._closing:
                    raise RuntimeError("this KVReceiver is closed")
                if request_id in self._active:
                    raise ValueError(f"KV request {request_id!r} is already being received")
                if request_id in self._finished:
                    raise ValueError(f"KV request {request_id!r} already finished; request ids are single-use")
                if (src_rank, key) in self._keys:
                    raise ValueError(f"KV request {request_id!r} has the wire key of active request "
                                     f"{self._keys[(src_rank, key)].id!r}; use another id")
                self._active[request_id] = self._keys[(src_rank, key)] = req
                parked = self._parked.pop((src_rank, key), [])
                self._parked_bytes -= sum(p.nbytes for _, p in parked if isinstance(p, torch.Tensor))
                early = self._failed_keys.pop((src_rank, key), None)
                gone = self._broken.get(src_rank)
            if early is not None:
                self._fail(req, early)
            for desc, payload in parked:
                self._apply(req, desc, payload)
            if gone is not None:  # what arrived before the stream ended stands; only what is missing fails
                self._fail(req, gone)
        return req.handle

    def handle(self, request_id) -> RecvHandle:
        with self._cv:
            req = self._active.get(request_id)
            if req is None:
                if request_id in self._finished:
                    raise ValueError(f"KV request {request_id!r} already finished")
                raise KeyError(f"KV request {request_id!r} is unknown to this receiver")
            return req.handle

    def cancel(self, request_id) -> None:
        """Stop receiving request_id: its handle raises, its later data is dropped."""
        with self._cv:
            req = self._active.get(request_id)
            if req is None:
                raise KeyError(f"KV request {request_id!r} is not being received")
        self._fail(req, KVTransferError(f"KV request {request_id!r}: cancelled by the receiver", request_id))

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait for every source's stream to end (its KVSender's close()),
        bounded by timeout (default comm.timeout), then fail what is left."""
        with self._cv:
            self._closing = True
        end = time.monotonic() + (self.comm.timeout if timeout is None else timeout)
        for t in self._threads.values():
            t.join(max(0.0, end - time.monotonic()))
        with self._cv:
            left = list(self._active.values())
            self._parked.clear()
            self._parked_bytes = 0
        for req in left:
            self._fail(req, KVTransferError(f"KV request {req.id!r}: the receiver closed before it arrived", req.id))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- the stream thread ------------------------------------------------------
    def _run(self, src: int) -> None:
        ln = link.Link(self.comm, src, wire.TAG)
        desc_t = torch.empty(wire.WORDS, dtype=torch.int64, device=self.comm.device)
        try:
            while True:
                ln.recv(desc_t)
                try:
                    desc = wire.Descriptor.parse(desc_t)
                except ValueError as e:
                    raise KVTransferError(f"KV stream from rank {src}: {e}") from None
                if desc.kind == wire.BYE:  # what is still expected from src never comes; what came stays
                    return self._break(src, KVTransferError(f"rank {src} closed its KV stream"), keep_parked=True)
                if desc.kind == wire.KEEPALIVE:
                    continue
                if desc.kind == wire.ABORT:
                    self._route(src, desc, KVTransferError("aborted by the sender"))
                    continue
                if desc.dtype not in DTYPES:
                    raise KVTransferError(f"KV stream from rank {src}: unknown dtype code {desc.dtype}")
                payload = torch.empty(desc.payload_shape(), dtype=DTYPES[desc.dtype], device=self.comm.device)
                ln.recv(payload)
                if wire.signed(delta.checksum(payload)) != desc.checksum:
                    self._route(src, desc, KVIntegrityError(
                        f"layer {desc.layer} blocks {desc.first_block}..{desc.first_block + desc.count - 1} arrived "
                        "corrupted (checksum mismatch); nothing was written"))
                    continue
                self._route(src, desc, payload)
        except PeerError as e:
            self._break(src, e)
        except BaseException as e:  # noqa: BLE001 - the stream is unusable: its requests fail, naming themselves
            self._break(src, KVTransferError(f"KV stream from rank {src} failed: {type(e).__name__}: {e}"))

    def _route(self, src: int, desc: wire.Descriptor, payload) -> None:
        """To the registered request, else parked (an error too: recv() raises it)."""
        with self._cv:
            req = self._keys.get((src, desc.key))
            if req is None:
                if (src, desc.key) in self._failed_keys:
                    return
                size = payload.nbytes if isinstance(payload, torch.Tensor) else 0
                if self._parked_bytes + size > self.max_parked_bytes:
                    dropped = self._parked.pop((src, desc.key), [])
                    self._parked_bytes -= sum(p.nbytes for _, p in dropped if isinstance(p, torch.Tensor))
                    self._failed_keys[(src, desc.key)] = KVTransferError(
                        f"its blocks arrived before recv() and passed max_parked_bytes={self.max_parked_bytes}")
                    return
                self._parked[(src, desc.key)].append((desc, payload))
                self._parked_bytes += size
                return
        with req.apply:
            self._apply(req, desc, payload)

    def _apply(self, req: _Request, desc: wire.Descriptor, payload) -> None:
        """Under req.apply: write one chunk into the request's blocks, or fail it."""
        if req.handle.error is not None:
            return
        if not isinstance(payload, torch.Tensor):
            return self._fail(req, payload)
        try:
            self._scatter(req, desc, payload)
        except (KVMismatchError, KVTransferError) as e:
            return self._fail(req, e)
        if desc.final:
            with self._cv:
                req.handle._layers.add(desc.layer)
                done = len(req.handle._layers) == req.handle.num_layers
                self._cv.notify_all()
            if done:
                self._retire(req)

    def _scatter(self, req: _Request, desc: wire.Descriptor, payload: torch.Tensor) -> None:
        rid = req.id
        if desc.layer >= len(req.layers):
            raise KVMismatchError(f"KV request {rid!r}: the sender sent layer {desc.layer}, this side has "
                                  f"{len(req.layers)} layers", rid)
        lay = req.layers[desc.layer]
        if CODES[lay.dtype] != desc.dtype or lay.block_shape != (desc.block_size, desc.heads, desc.head_dim):
            raise KVMismatchError(f"KV request {rid!r} layer {desc.layer}: the sender's blocks are "
                                  f"{DTYPES[desc.dtype]} {[desc.block_size, desc.heads, desc.head_dim]}, this "
                                  f"cache's {lay.dtype} {list(lay.block_shape)}", rid)
        ids = req.ids[lay.device]
        lo = max(desc.first_block, req.first_block)  # logical blocks before first_block are dropped
        hi = desc.first_block + desc.count
        if hi - req.first_block > ids.numel():
            raise KVMismatchError(f"KV request {rid!r} layer {desc.layer}: the sender sent logical blocks up to "
                                  f"{hi - 1}, this side named {ids.numel()} from block {req.first_block}", rid)
        if hi > lo:
            part = payload[:, lo - desc.first_block:]
            lay.scatter(ids[lo - req.first_block:hi - req.first_block], part.to(lay.device))
        if desc.scales:
            try:
                lay.set_scales(desc.scales, desc.k_scale, desc.v_scale)
            except ValueError as e:
                raise KVMismatchError(f"KV request {rid!r} layer {desc.layer}: {e}", rid) from None
        if lay.device.type == "cuda":
            torch.cuda.current_stream(lay.device).synchronize()  # landed before wait() returns

    # --- bookkeeping ------------------------------------------------------------
    def _retire(self, req: _Request) -> None:
        with self._cv:
            if self._active.get(req.id) is req:
                del self._active[req.id]
                self._keys.pop((req.src, req.key), None)
                self._finished[req.id] = None
                while len(self._finished) > _FINISHED_KEPT:
                    self._finished.popitem(last=False)
            self._cv.notify_all()

    def _fail(self, req: _Request, err: BaseException) -> None:
        if getattr(err, "request_id", None) is None:
            msg = f"KV request {req.id!r} from rank {req.src}: {type(err).__name__}: {err}"
            named = (type(err) if isinstance(err, KVTransferError) else KVTransferError)(msg, req.id)
            named.__cause__ = err
            err = named
        with self._cv:
            if req.handle.error is None and len(req.handle._layers) < req.handle.num_layers:
                req.handle.error = err
            self._cv.notify_all()
        self._retire(req)

    def _break(self, src: int, err: BaseException, keep_parked: bool = False) -> None:
        """src's stream is gone: its incomplete requests fail, and so does a later recv() from it, except
        for what it parked before a clean close (keep_parked: its sender's BYE)."""
        with self._cv:
            self._broken[src] = err
            reqs = [r for r in self._active.values() if r.src == src]
            for k in [k for k in self._parked if k[0] == src and not keep_parked]:
                self._parked_bytes -= sum(p.nbytes for _, p in self._parked.pop(k) if isinstance(p, torch.Tensor))
        for req in reqs:
            with req.apply:  # a recv() applying what was parked finishes first: only what is missing fails
                self._fail(req, err)
