"""A round part's plan, from the gathered manifests only: every rank runs
these pure functions on the same input, so every rank holds the same plan
(which pieces move, from whom, delta or full and why, in which bucket)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codec import CODED
from ..codec import MismatchError

_DTYPES = {str(d): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
                               torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn,
                               torch.float8_e5m2)}


DELTA_DTYPES = frozenset(str(d) for d in CODED)  # the dtypes the delta codec codes


def dtype_named(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise MismatchError(f"unknown dtype {name!r} in a weight manifest")
    return _DTYPES[name]


def rows_of(shape) -> tuple:
    """(rows, elements per row) of a shape: tensors are cut along dim 0 (a scalar is one row)."""
    shape = list(shape)
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


@dataclass(frozen=True)
class Chunk:
    """Rows [g0, g1) of tensor `name` (global row numbers), sender `src` to receiver `dst`."""
    id: int
    src: int
    dst: int
    name: str
    g0: int
    g1: int
    delta: bool
    reason: str  # why full ("" for delta)


@dataclass
class Part:
    version: int
    final: bool
    meta: dict        # name -> (dtype str, global shape list)
    held: dict        # sender rank -> {name: (row0, rows)}
    chunks: list      # every Chunk of the part, in id order
    buckets: list     # bucket b -> list of chunk ids
    taken: dict       # receiver rank -> set of names it received in this part


def _entry_meta(rank, e, meta, what):
    name, dt, shape = e["name"], e["dtype"], list(e["shape"])
    dtype_named(dt)
    have = meta.setdefault(name, (dt, shape, rank))
    if (have[0], have[1]) != (dt, shape):
        raise MismatchError(f"weight {name!r}: rank {have[2]} has {have[0]}{have[1]} but rank {rank}'s {what} "
                            f"is {dt}{shape}")


def _why_full(s: dict, r: dict, sent: dict, want: dict, whole: bool) -> str:
    """'' when the chunk can travel as a delta, else the reason it travels full."""
    if sent["dtype"] not in DELTA_DTYPES:
        return f"no delta coding for {sent['dtype']}"
    if not s["delta"] or not r["delta"]:
        return "delta coding unavailable or off" + (" on the sender" if not s["delta"] else " on the receiver")
    base, held = sent.get("base_version"), want.get("version")
    if base is None:
        return ("first sync" if held is None else
                f"sender keeps no base (restart or keep_base=None); receiver holds version {held}")
    if held is None:
        return "receiver holds no version (late join or restart)"
    if held < base:
        return f"missed step: receiver holds version {held}, sender's base is {base}"
    if held != base:
        return f"version skew: receiver holds version {held}, sender's base is {base}"
    if whole and want.get("checksum") is not None and want["checksum"] != sent.get("base_checksum"):
        return "receiver's copy differs from the base (checksum)"
    return ""


def check_refused(manifests: list) -> None:
    """A rank that refuses the part (a manifest's "refuse": why) refuses it
    on every rank, before any data moves: its peers learn why at once
    rather than wait out their timeout."""
    why = [f"rank {r} {m['refuse']}" for r, m in enumerate(manifests) if m.get("refuse")]
    if why:
        raise MismatchError("weight sync refused: " + "; ".join(why))


def overlapping(spans: list) -> list:
    """Pairs of names whose byte ranges overlap, from (start, end, name)
    spans (end exclusive): sorted by start, each span is compared with the
    furthest-reaching one before it, so any overlap yields at least one pair
    (n log n, for thousands of buffers)."""
    out, reach = [], None  # (end, name) of the furthest-reaching span so far
    for a, b, name in sorted(s for s in spans if s[1] > s[0]):
        if reach is not None and a < reach[0]:
            out.append((reach[1], name))
        if reach is None or b > reach[0]:
            reach = (b, name)
    return out


def plan_part(manifests: list, bucket_bytes: int) -> Part:
    """The plan of one part from every rank's manifest (index = rank)."""
    check_refused(manifests)
    senders = {r: m for r, m in enumerate(manifests) if m["role"] == "send"}
    receivers = {r: m for r, m in enumerate(manifests) if m["role"] == "recv"}
    if not senders or not receivers:
        raise MismatchError(f"a weight sync round needs a sender and a receiver; roles by rank: "
                            f"{[m['role'] for m in manifests]}")
    versions = {m["version"] for m in senders.values()}
    if len(versions) != 1:
        raise MismatchError(f"senders send different versions: {sorted(versions)}")
    meta, held, order = {}, {}, []
    for r, m in sorted(senders.items()):
        held[r] = {}
        for e in m["tensors"]:
            _entry_meta(r, e, meta, "tensor")
            if e["name"] in held[r]:
                raise MismatchError(f"rank {r} sends weight {e['name']!r} twice in one part")
            n, _ = rows_of(e["shape"])
            if not (0 <= e["row0"] and e["row0"] + e["rows"] <= n):
                raise MismatchError(f"rank {r} holds rows [{e['row0']}, {e['row0'] + e['rows']}) of "
                                    f"{e['name']!r}, which has {n}")
            held[r][e["name"]] = e
            if e["name"] not in order:
                order.append(e["name"])
    chunks, taken, pairs = [], {}, {}
    for dst, m in sorted(receivers.items()):
        taken[dst] = set()
        wants = m["wants"]
        for name in order:
            dt, shape = meta[name][0], meta[name][1]
            n, per_row = rows_of(shape)
            if wants == "all":
                want = dict(m["held"].get(name, {}), row0=0, rows=n)
            elif name in wants:
                want = wants[name]
                _entry_meta(dst, dict(want, name=name), meta, "receive buffer")
            else:
                continue
            a, b = want["row0"], want["row0"] + want["rows"]
            if not (0 <= a <= b <= n):
                raise MismatchError(f"rank {dst} asks for rows [{a}, {b}) of {name!r}, which has {n}")
            taken[dst].add(name)
            row_bytes = max(1, per_row * torch.empty((), dtype=dtype_named(dt)).element_size())
            step = max(1, bucket_bytes // row_bytes)
            for src, g0, g1 in _owners(held, name, a, b, dst):
                s = held[src][name]
                whole = (g0, g1) == (0, n) and (s["row0"], s["rows"]) == (0, n) and (a, b) == (0, n)
                why = _why_full(senders[src], m, s, want, whole)
                for c0 in range(g0, g1, step):
                    pairs.setdefault((src, dst), []).append(len(chunks))
                    chunks.append(Chunk(len(chunks), src, dst, name, c0, min(g1, c0 + step), not why, why))
    meta = {n: (v[0], v[1]) for n, v in meta.items()}  # drop who declared it first
    buckets = []
    for ids in pairs.values():
        for b, group in enumerate(_pack(ids, chunks, meta, bucket_bytes)):
            if b == len(buckets):
                buckets.append([])
            buckets[b].extend(group)
    for group in buckets:
        group.sort()
    return Part(versions.pop(), all(m["final"] for m in senders.values()), meta, held, chunks, buckets, taken)


def _owners(held, name, a, b, dst):
    """[(sender, g0, g1)] covering rows [a, b) of `name`: each row from the
    lowest-ranked sender that holds it (replicas: the first)."""
    if a == b:
        return []
    cuts = sorted({a, b, *(x for h in held.values() if name in h
                           for x in (h[name]["row0"], h[name]["row0"] + h[name]["rows"]) if a < x < b)})
    out = []
    for g0, g1 in zip(cuts, cuts[1:]):
        src = next((r for r in sorted(held) if name in held[r]
                    and held[r][name]["row0"] <= g0 and g1 <= held[r][name]["row0"] + held[r][name]["rows"]), None)
        if src is None:
            raise MismatchError(f"no sender holds rows [{g0}, {g1}) of {name!r}, which rank {dst} asks for")
        if out and out[-1][0] == src and out[-1][2] == g0:
            out[-1] = (src, out[-1][1], g1)
        else:
            out.append((src, g0, g1))
    return out


def chunk_bytes(c: Chunk, meta) -> int:
    dt, shape = meta[c.name]
    return (c.g1 - c.g0) * rows_of(shape)[1] * torch.empty((), dtype=dtype_named(dt)).element_size()


def _pack(ids, chunks, meta, bucket_bytes):
    """A pair's chunks, in order, in buckets of at most bucket_bytes (a chunk never splits)."""
    out, size = [], 0
    for i in ids:
        n = chunk_bytes(chunks[i], meta)
        if not out or size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def check_round_end(manifests: list, taken_total: dict) -> None:
    """Names in a receiver's buffers that no part of the round supplied: MismatchError on every rank."""
    for r, m in enumerate(manifests):
        if m["role"] == "recv" and m["wants"] != "all":
            missing = sorted(set(m["wants"]) - taken_total.get(r, set()))
            if missing:
                raise MismatchError(f"rank {r} expects weights no sender sent: {missing[:8]}"
                                    + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))


def check_unwanted(part: Part, manifests: list) -> None:
    """A sent name that no receiver takes (when no receiver takes everything): MismatchError on every rank."""
    if any(m["role"] == "recv" and m["wants"] == "all" for m in manifests):
        return
    took = set().union(*part.taken.values()) if part.taken else set()
    extra = sorted(set(part.meta) - took)
    if extra:
        raise MismatchError(f"weights sent that no receiver takes: {extra[:8]}"
                            + (f" (+{len(extra) - 8} more)" if len(extra) > 8 else ""))
