"""Deferred decode checks: a GPU decode into out= queues its work and returns,
so its error word is read later (README, "Decompress without a host sync").

Each queued decode gets one int32 slot of a zeroed device slab (4096 slots,
one memset per slab, no launch per call). The slot is read at the next point
where the API synchronizes anyway: pz.check(), decompress or decompress_batch
without out=, inspect, compressed_size and trim read only the slots of decodes
queued on the stream they synchronized; pz.check() synchronizes the device and
reads every slot. A failed decode raises FormatError naming the call."""
from __future__ import annotations

import threading
from typing import Optional

import torch

from . import _C

_SLOTS = 4096
_lock = threading.Lock()
_slabs: dict = {}     # device index -> [slab, next slot, event after its memset, its stream]
_pending: dict = {}   # device index -> [(slab, slot, stream id, what)]


def slot(device: torch.device, what: str) -> torch.Tensor:
    """A zeroed int32 error word on device for one decode queued on the
    current stream, registered for the next check."""
    idx = device.index
    stream = torch.cuda.current_stream(device)
    with _lock:
        s = _slabs.get(idx)
        if s is None or s[1] == _SLOTS:
            slab = torch.zeros(_SLOTS, dtype=torch.int32, device=device)
            ev = torch.cuda.Event()
            ev.record(stream)
            s = _slabs[idx] = [slab, 0, ev, stream.stream_id]
        slab, k, ev, made_on = s
        s[1] += 1
        _pending.setdefault(idx, []).append((slab, k, stream.stream_id, what))
    if made_on != stream.stream_id:
        stream.wait_event(ev)  # the slab's zeros land before this stream's decode writes
    return slab[k:k + 1]


def _raise(failed: list) -> None:
    what, bits = failed[0]
    more = f" (and {len(failed) - 1} more failed decodes)" if len(failed) > 1 else ""
    raise _C.FormatError(f"{what}: {_C.decode_error_text(bits)}{more}")


def _read(entries: list) -> list:
    """(what, bits) of the failed entries, whose kernels have completed."""
    failed = []
    by_slab: dict = {}
    for e in entries:
        by_slab.setdefault(id(e[0]), (e[0], []))[1].append(e)
    for slab, es in by_slab.values():
        words = slab.cpu().tolist()  # one copy per slab
        failed += [(what, words[k]) for _, k, _, what in es if words[k]]
    return failed


def check_synced(device: torch.device) -> None:
    """Called right after the API synchronized device's current stream:
    checks the decodes queued on that stream."""
    if device.type != "cuda":
        return
    idx, sid = device.index, torch.cuda.current_stream(device).stream_id
    with _lock:
        mine = [e for e in _pending.get(idx, ()) if e[2] == sid]
        if not mine:
            return
        _pending[idx] = [e for e in _pending[idx] if e[2] != sid]
    failed = _read(mine)
    if failed:
        _raise(failed)


def check(device: Optional[torch.device | int | str] = None) -> None:
    """Waits for every decode queued with out= on device (all devices when
    None) and raises FormatError if any of them met a corrupted, truncated or
    mismatched stream. Decodes it has checked are not checked again."""
    if device is None:
        with _lock:
            devices = [torch.device("cuda", i) for i, es in _pending.items() if es]
    else:
        d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if d.type != "cuda":
            return
        devices = [torch.device("cuda", torch.cuda.current_device() if d.index is None else d.index)]
    failed = []
    for d in devices:
        torch.cuda.synchronize(d)
        with _lock:
            entries = _pending.pop(d.index, [])
        failed += _read(entries)
    if failed:
        _raise(failed)


def pending(device: Optional[int] = None) -> int:
    """How many queued decodes are not checked yet (on device, or all)."""
    with _lock:
        if device is not None:
            return len(_pending.get(device, ()))
        return sum(len(es) for es in _pending.values())
