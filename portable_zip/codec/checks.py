"""Deferred decode checks: a GPU decode into out= queues its work and returns,
so its error word is read later (README, "Decompress without a host sync").

Each queued decode gets one int32 slot of a zeroed device slab (4096 slots,
one memset per slab, a slab per stream, no launch per call); a call takes
the slots of all its decodes under one lock. The slot is read at the next
point where the API synchronizes anyway: pz.check(), decompress or
decompress_batch without out=, inspect, compressed_size and trim read only
the slots of decodes queued on the stream they synchronized; pz.check()
synchronizes the device and reads every slot. A failed decode raises
FormatError naming the call."""
from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch

import portable_zip._C as _C
from . import device as _device

_SLOTS = 4096
_lock = threading.Lock()
_seq = 0              # registrations so far: an entry is checked only by a sync that began after it
# (device index, stream) -> [slab, next slot, slots, address]. A slab per stream:
# its zeros are written on the stream whose decodes use it, so they land first.
_slabs: dict = {}
# device index -> [(seq, slab, slots, stream, what, labels)]: an entry per call
# (per launch), slots[j] the word of its decode j, named by labels[j] if any.
_pending: dict = {}


def slots(index: int, stream: int, n: int) -> tuple:
    """n consecutive zeroed int32 error words on GPU index for decodes about to
    be queued on stream (the raw handle of that device's current stream):
    (slab, first slot k, address of slot k). Register them with register()
    once the decodes are queued."""
    if _device.capturing():  # a capture's zeros land only when the graph runs: its slab is never kept
        slab = torch.zeros(n, dtype=torch.int32, device=torch.device("cuda", index))
        return slab, 0, slab.data_ptr()
    key = (index, stream)
    with _lock:
        s = _slabs.get(key)
        if s is None or s[1] + n > s[2]:
            slab = torch.zeros(max(_SLOTS, n), dtype=torch.int32,  # on the current stream: stream
                               device=torch.device("cuda", index))
            s = _slabs[key] = [slab, 0, slab.numel(), slab.data_ptr()]
        k = s[1]
        s[1] += n
    return s[0], k, s[3] + 4 * k


def register(index: int, stream: int, slab: torch.Tensor, ks: Sequence[int], what: str,
             labels: Optional[Sequence[int]] = None) -> None:
    """Queues the checks of slab's slots ks, whose decodes are now queued on
    stream of device index: decode j named what, or "what stream i" for
    labels[j] = i."""
    global _seq
    with _lock:
        _seq += 1
        _pending.setdefault(index, []).append((_seq, slab, ks, stream, what, labels))


def mark() -> int:
    """Taken before a sync: the entries registered so far are the ones it covers."""
    with _lock:
        return _seq


def _raise(failed: list) -> None:
    """One FormatError naming every failed decode (the first 16 in full)."""
    lines = [f"{what}: {_C.decode_error_text(bits)}" for what, bits in failed[:16]]
    more = f"; and {len(failed) - 16} more failed decodes" if len(failed) > 16 else ""
    raise _C.FormatError("; ".join(lines) + more)


def name(what: str, i: Optional[int]) -> str:
    """How errors name a decode: the call, and the stream's index in a batch."""
    return what if i is None else f"{what} stream {i}"


def _read(entries: list) -> list:
    """(what, bits) of the failed entries, whose kernels have completed."""
    failed = []
    by_slab: dict = {}
    for e in entries:
        by_slab.setdefault(id(e[1]), (e[1], []))[1].append(e)
    for slab, es in by_slab.values():
        words = slab.cpu().numpy()  # one copy per slab
        for _, _, ks, _, what, labels in es:
            bits = words[ks.start:ks.stop] if isinstance(ks, range) else words[list(ks)]
            failed += [(name(what, None if labels is None else labels[j]) + " (queued)", int(bits[j]))
                       for j in bits.nonzero()[0]]
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
    sid = _device.stream(device.index)
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
        es = _pending.get(device, []) if device is not None else [e for es in _pending.values() for e in es]
        return sum(len(e[2]) for e in es)
