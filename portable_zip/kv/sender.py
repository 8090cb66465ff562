"""KVSender: a prefill rank's side. Each request goes to one receiver rank;
its layers are posted as they are computed (send_layer returns at once) and
leave in posting order on that receiver's stream, one thread per stream."""
from __future__ import annotations

import collections
import threading
import time
from typing import Optional

import torch

from ..codec import delta
from ..comm import PeerError
from . import link, wire
from .errors import KVTransferError
from .layout import CODES, as_layer, as_layers, block_ids

# Test hook: called as tamper(descriptor, payload) after the checksum is
# taken and before the post (a corrupted or forged transfer).
tamper = None
_FINISHED_KEPT = 1 << 16  # finished ids remembered, to refuse a reuse
WINDOW = 4  # items (a layer's descriptor and payload) a stream keeps in flight


class SendHandle:
    """One request's sending: wait() returns once every layer's last chunk has
    left, and raises the request's KVTransferError otherwise."""

    def __init__(self, request_id, dst: int, num_layers: int):
        self.request_id, self.dst, self.num_layers = request_id, dst, num_layers
        self.error: Optional[BaseException] = None
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> None:
        if not self._done.wait(timeout):
            raise KVTransferError(f"KV request {self.request_id!r}: not sent within {timeout:g} s (still running)",
                                  self.request_id)
        if self.error is not None:
            raise self.error


class _Request:
    def __init__(self, request_id, key, dst, num_layers):
        self.id, self.key, self.dst = request_id, key, dst
        self.handle = SendHandle(request_id, dst, num_layers)
        self.final = set()      # layers whose last chunk was posted
        self.queued = 0         # chunks posted, not yet sent


class _Stream:
    """The ordered stream to one receiver rank and the thread that sends it."""

    def __init__(self, owner: "KVSender", dst: int):
        self.owner, self.dst, self.link = owner, dst, link.Link(owner.comm, dst, wire.TAG)
        self.items = collections.deque()
        self.cv = threading.Condition(owner._lock)
        self.broken: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name=f"pz-kv-send-{dst}", daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        self.items.append(item)
        self.cv.notify()

    def _next(self):
        """The next item, or a keepalive once the stream was idle for a while."""
        with self.cv:
            deadline = time.monotonic() + self.owner.keepalive
            while not self.items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return ("keepalive", None, wire.Descriptor(wire.KEEPALIVE), None, None)
                self.cv.wait(left)
            return self.items.popleft()

    def _run(self) -> None:
        # Up to WINDOW items in flight: a layer's descriptor and payload go out
        # back to back and the next layer's follow before their ACKs are in, so
        # the stream pays the link's time, not a round trip per message.
        window = collections.deque()
        try:
            while True:
                with self.cv:
                    idle = not self.items
                while window and (idle or len(window) >= WINDOW):
                    self._settle(window.popleft())
                kind, req, desc, payload, event = self._next()
                if req is not None and req.handle.error is not None:
                    self.owner._sent(req)  # failed or aborted meanwhile: its queued chunks are dropped
                    continue
                if event is not None:
                    event.synchronize()  # the gather, queued on the caller's stream
                if payload is not None:
                    desc.checksum = wire.signed(delta.checksum(payload))
                t = desc.tensor().to(self.owner.comm.device)  # the Communicator moves its own device's tensors
                if tamper is not None and payload is not None:
                    tamper(t, payload)
                works = [self.link.isend(t)] + ([self.link.isend(payload)] if payload is not None else [])
                window.append((works, req))
                if kind == "bye":
                    while window:
                        self._settle(window.popleft())
                    return
        except PeerError as e:
            self.owner._broke(self, e)
        except BaseException as e:  # noqa: BLE001 - a bug here fails the stream's requests, not silently
            self.owner._broke(self, KVTransferError(f"KV stream to rank {self.dst} failed: {type(e).__name__}: {e}"))

    def _settle(self, item) -> None:
        works, req = item
        for w in works:
            w.wait()
        if req is not None:
            self.owner._sent(req)


class KVSender:
    """Sends requests' KV blocks over comm (a pz.Communicator) to the
    receiver ranks in destinations, each running a KVReceiver that lists this
    rank among its sources. Thread-safe.

    keepalive: seconds an idle stream waits before it sends a keepalive
    (default a quarter of comm.timeout), so a receiver waiting on it never
    mistakes quiet for death."""

    def __init__(self, comm, destinations, *, keepalive: Optional[float] = None):
        self.comm = comm
        self.rank = comm.rank
        dsts = sorted(set(int(d) for d in destinations))
        if not dsts or any(d == self.rank or not 0 <= d < comm.world for d in dsts):
            raise ValueError(f"destinations must be other ranks of the Communicator (world {comm.world}, this "
                             f"rank {self.rank}), got {list(destinations)}")
        self.keepalive = float(keepalive) if keepalive is not None else max(0.05, comm.timeout / 4)
        self._lock = threading.Lock()
        self._active = {}            # request_id -> _Request
        self._keys = {}              # wire key -> request_id
        self._finished = collections.OrderedDict()
        self._closed = False
        self._streams = {d: _Stream(self, d) for d in dsts}

    # --- the API ------------------------------------------------------------
    def start(self, request_id, dst_rank: int, num_layers: int) -> SendHandle:
        """Register a request bound for dst_rank with num_layers layers.
        Raises ValueError for an id already active or finished."""
        key = wire.request_key(request_id)
        if dst_rank not in self._streams:
            raise ValueError(f"KV request {request_id!r}: rank {dst_rank} is not a destination of this sender "
                             f"({sorted(self._streams)})")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        with self._lock:
            self._open()
            self._fresh(request_id, key)
            req = self._active[request_id] = _Request(request_id, key, dst_rank, num_layers)
            self._keys[key] = request_id
            broken = self._streams[dst_rank].broken
        if broken is not None:
            self._fail(req, broken)
        return req.handle

    def send_layer(self, request_id, layer: int, kv_layer, block_ids_, *, first_block: int = 0,
                   final: bool = True) -> None:
        """Post one layer's blocks block_ids_ (this rank's ids; they are the
        request's logical blocks first_block, first_block + 1, ...) and return
        at once: the blocks are copied out (on a GPU, queued on the current
        stream), so the cache may be written again. final: the layer's last
        chunk of this request (chunked prefill posts earlier chunks with
        final=False). Raises KeyError for an unknown request, ValueError for
        a finished one, the request's error if it failed."""
        lay = as_layer(kv_layer)
        with self._lock:
            req = self._request(request_id)
        if req.handle.error is not None:
            raise req.handle.error
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < req.handle.num_layers:
            raise ValueError(f"KV request {request_id!r}: layer {layer!r} is not one of its "
                             f"{req.handle.num_layers} layers")
        if layer in req.final:
            raise ValueError(f"KV request {request_id!r}: layer {layer} was already sent with final=True")
        if isinstance(first_block, bool) or not isinstance(first_block, int) or first_block < 0:
            raise ValueError(f"first_block must be a non-negative int, got {first_block!r}")
        ids = block_ids(block_ids_, lay.num_blocks, f"KV request {request_id!r} block_ids", unique=False)
        payload = lay.gather(ids.to(lay.device))
        event = None
        if payload.is_cuda:
            event = torch.cuda.Event()
            event.record()
        bs, heads, hd = lay.block_shape
        n, k, v = lay.scale_bits()
        desc = wire.Descriptor(wire.LAYER, req.key, layer, first_block, ids.numel(), int(bool(final)),
                               CODES[lay.dtype], bs, heads, hd, 0, n, k, v)
        with self._lock:
            self._open()
            broken = self._streams[req.dst].broken
            if broken is not None or req.handle.error is not None:
                raise req.handle.error or KVTransferError(f"KV request {request_id!r}: the stream to rank "
                                                          f"{req.dst} failed: {broken}", request_id)
            if final:
                req.final.add(layer)
            req.queued += 1
            self._streams[req.dst].put(("layer", req, desc, payload, event))

    def send(self, request_id, dst_rank: int, kv_caches, block_ids_, *, first_block: int = 0,
             final: bool = True) -> SendHandle:
        """Every layer of kv_caches (a sequence or dict of per-layer caches),
        blocks block_ids_: start (unless started) then send_layer for each."""
        layers = as_layers(kv_caches)
        with self._lock:
            known = self._active.get(request_id)
        handle = known.handle if known is not None else self.start(request_id, dst_rank, len(layers))
        if known is not None and known.dst != dst_rank:
            raise ValueError(f"KV request {request_id!r} goes to rank {known.dst}, not {dst_rank}")
        for i, lay in enumerate(layers):
            self.send_layer(request_id, i, lay, block_ids_, first_block=first_block, final=final)
        return handle

    def handle(self, request_id) -> SendHandle:
        """The active request's handle (KeyError for an unknown or finished one)."""
        with self._lock:
            return self._request(request_id).handle

    def abort(self, request_id, reason: str = "aborted by the sender") -> None:
        """Give up a request: its queued chunks are dropped, its handle raises,
        and the receiver fails it too."""
        with self._lock:
            req = self._request(request_id)
            stream = self._streams[req.dst]
            if stream.broken is None:
                stream.put(("abort", None, wire.Descriptor(wire.ABORT, req.key), None, None))
        self._fail(req, KVTransferError(f"KV request {request_id!r}: {reason}", request_id))

    def close(self) -> None:
        """Send what is queued, tell every receiver this stream ends, and join
        the threads (bounded by comm.timeout each). Requests still without a
        final chunk on every layer fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for s in self._streams.values():
                if s.broken is None:
                    s.put(("bye", None, wire.Descriptor(wire.BYE), None, None))
        for s in self._streams.values():
            s.thread.join(self.comm.timeout)
        with self._lock:
            left = list(self._active.values())
        for req in left:
            self._fail(req, KVTransferError(f"KV request {req.id!r}: the sender closed before its last layer",
                                            req.id))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- bookkeeping (under self._lock where it says) ---------------------------
    def _open(self) -> None:
        if self._closed:
            raise RuntimeError("this KVSender is closed")

    def _fresh(self, request_id, key) -> None:
        """Under the lock: raise for an id in use, finished, or colliding."""
        if request_id in self._active:
            raise ValueError(f"KV request {request_id!r} is already being sent")
        if request_id in self._finished:
            raise ValueError(f"KV request {request_id!r} already finished; request ids are single-use")
        if key in self._keys:
            raise ValueError(f"KV request {request_id!r} has the wire key of active request "
                             f"{self._keys[key]!r}; use another id")

    def _request(self, request_id) -> _Request:
        """Under the lock."""
        req = self._active.get(request_id)
        if req is None:
            if request_id in self._finished:
                err = self._finished[request_id]
                if err is not None:
                    raise err  # it failed: say why, naming it
                raise ValueError(f"KV request {request_id!r} already finished")
            raise KeyError(f"KV request {request_id!r} is unknown to this sender")
        return req

    def _retire(self, req: _Request) -> None:
        """Under the lock."""
        if self._active.get(req.id) is req:
            del self._active[req.id]
            self._keys.pop(req.key, None)
            self._finished[req.id] = req.handle.error
            while len(self._finished) > _FINISHED_KEPT:
                self._finished.popitem(last=False)

    def _sent(self, req: _Request) -> None:
        with self._lock:
            req.queued -= 1
            done = req.queued == 0 and (len(req.final) == req.handle.num_layers or req.handle.error is not None)
            if done:
                self._retire(req)
        if done:
            req.handle._done.set()

    def _fail(self, req: _Request, err: BaseException) -> None:
        with self._lock:
            if req.handle.error is None:
                req.handle.error = err
            self._retire(req)
            if req.id in self._finished:
                self._finished[req.id] = req.handle.error
        req.handle._done.set()

    def _broke(self, stream: _Stream, err: BaseException) -> None:
        """The stream's peer failed: every request bound for it fails naming
        itself, and what they hold is dropped."""
        with self._lock:
            stream.broken = err
            stream.items.clear()
            reqs = [r for r in self._active.values() if r.dst == stream.dst]
        for req in reqs:
            e = KVTransferError(f"KV request {req.id!r} to rank {stream.dst} failed: {type(err).__name__}: {err}",
                                req.id)
            e.__cause__ = err
            self._fail(req, e)
