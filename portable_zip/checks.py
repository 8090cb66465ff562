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
_seq = 0              # registrations so far: an entry is checked only by a sync that began after it
_slabs: dict = {}     # device index -> [slab, next slot, event after its memset, its stream]
_pending: dict = {}   # device index -> [(seq, slab, slot, stream id, what)]


def slot(device: torch.device) -> tuple:
    """A zeroed int32 error word on device for one decode about to be queued
    on the current stream: (slab, index, word). Register it with register()
    once the decode is queued."""
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
    if made_on != stream.stream_id:
        stream.wait_event(ev)  # the slab's zeros land before this stream's decode writes
    return slab, k, slab[k:k + 1]


def register(device: torch.device, slab: torch.Tensor, k: int, what: str) -> None:
    """Queues the check of slot k, whose decode is now queued on the current stream."""
    global _seq
    sid = torch.cuda.current_stream(device).stream_id
    with _lock:
        _seq += 1
        _pending.setdefault(device.index, []).append((_seq, slab, k, sid, what))


def mark() -> int:
    """Taken before a sync: the entries registered so far are the ones it covers."""
    with _lock:
        return _seq


def _raise(failed: list) -> None:
    what, bits = failed[0]
    more = f" (and {len(failed) - 1} more failed decodes)" if len(failed) > 1 else ""
    raise _C.FormatError(f"{what}: {_C.decode_error_text(bits)}{more}")


def _read(entries: list) -> list:
    """(what, bits) of the failed entries, whose kernels have completed."""
    failed = []
    by_slab: dict = {}
    for e in entries:
        by_slab.setdefault(id(e[1]), (e[1], []))[1].append(e)
    for slab, es in by_slab.values():
        words = slab.cpu().tolist()  # one copy per slab
        failed += [(what, words[k]) for _, _, k, _, what in es if words[k]]
    return failed


def _take(idx: int, keep) -> list:
    """Removes and returns the device's entries for which keep(entry) is true."""
    with _lock:
        es = _pending.get(idx, [])
        mine = [e for e in es if keep(e)]
        if mine:
            _pending[idx] = [e for e in es if not keep(e)]
        return mine


def check_synced(device: torch.device, since: int) -> None:
    """Called right after the API synchronized device's current stream, with
    mark() taken before that sync: checks the decodes queued on that stream
    and registered before it."""
    if device.type != "cuda":
        return
    sid = torch.cuda.current_stream(device).stream_id
    mine = _take(device.index, lambda e: e[0] <= since and e[3] == sid)
    failed = _read(mine) if mine else []
    if failed:
        _raise(failed)


def check(device: Optional[torch.device | int | str] = None) -> None:
    """Waits for every decode queued with out= on device (all devices when
    None) and raises FormatError if any of them met a corrupted, truncated or
    mismatched stream. Decodes it has checked are not checked again; decodes
    other threads queue while it waits are left for the next check."""
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
        since = mark()
        torch.cuda.synchronize(d)
        failed += _read(_take(d.index, lambda e: e[0] <= since))
    if failed:
        _raise(failed)


def pending(device: Optional[int] = None) -> int:
    """How many queued decodes are not checked yet (on device, or all)."""
    with _lock:
        if device is not None:
            return len(_pending.get(device, ()))
        return sum(len(es) for es in _pending.values())
