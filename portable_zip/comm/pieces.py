"""What an exchange is made of: per-pair plans, the units each direction
sends (a raw tensor, or one piece of a coded one), the waves they travel
in, and what one op's exchanges share (Call). Both sides of a pair derive
the same units and waves from the same specs, so the sizes here are part of
the agreement rule (docs/COMM.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .settings import Settings
from .deadline import Deadline

PIECE_MIN_BYTES, PIECE_MAX_BYTES = 16 << 20, 128 << 20
PIECE_ALIGN = 8192  # elements: whole fp8 pairs and whole 8-symbol vector chunks


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


@dataclass(frozen=True)
class Call:
    """What every exchange of one Communicator call shares: its deadline,
    the SM budget of its codec launches (0: all SMs), and the settings."""
    deadline: Deadline
    max_sms: int
    settings: Settings


def piece_bytes(nbytes: int) -> int:
    """Bytes per pipelined piece of a compressed transfer of nbytes: large
    transfers are cut so compressing piece k+1 overlaps sending piece k (and
    decompressing overlaps receiving); few pieces, as each costs host work."""
    if nbytes <= 2 * PIECE_MIN_BYTES:
        return nbytes
    return min(PIECE_MAX_BYTES, max(PIECE_MIN_BYTES, nbytes // 4))


def piece_elems(numel: int, itemsize: int, override: int = 0) -> int:
    """Elements per piece (piece_bytes, or override: PZ_PIECE_BYTES); the sender announces it."""
    if not override and numel * itemsize <= 2 * PIECE_MIN_BYTES:
        return max(numel, 1)
    target = override or piece_bytes(numel * itemsize)
    return max(target // itemsize // PIECE_ALIGN * PIECE_ALIGN, PIECE_ALIGN)  # even: fp8 pairs stay whole


@dataclass
class Unit:
    """One message of a direction's sequence: a whole raw tensor or one piece of a coded one."""
    peer: int
    t: torch.Tensor          # the piece: source (send) or destination (receive)
    coded: bool
    key: tuple = ()          # sends: (source tensor, piece index), compressed once for every peer
    buf: Optional[torch.Tensor] = None   # the stream (send) or the receive buffer
    lay: Optional[dict] = None
    total: int = 0                       # the stream's size, from its header
    got: int = 0                         # sized receives: the bytes that arrived
    head: Optional[tuple] = None         # receives: (header bytes, parsed header)


def units(peer: int, tensors: List[torch.Tensor], coded: List[bool], pieces: List[int], keys=None) -> List[Unit]:
    out = []
    for i, t in enumerate(tensors):
        if not coded[i]:
            out.append(Unit(peer, t, False))
            continue
        per = pieces[i]
        for k, at in enumerate(range(0, t.numel(), per)):
            out.append(Unit(peer, t[at: at + per], True, (keys[i], k) if keys else ()))
    return out


def waves(us: List[Unit], wave_bytes: int) -> List[List[Unit]]:
    """Consecutive units in groups of at least wave_bytes. Both sides of a
    direction derive the same waves from the control messages, and group w on
    every rank holds wave w of each of its directions, so no group waits on a
    later one anywhere (NCCL groups block until all their transfers are done)."""
    out, cur, n = [], [], 0
    for u in us:
        cur.append(u)
        n += u.t.nbytes
        if n >= wave_bytes:
            out.append(cur)
            cur, n = [], 0
    return out + ([cur] if cur else [])


def in_wave(ws: Dict[int, List[List[Unit]]], w: int) -> List[Unit]:
    """Wave w's units of every peer (peers with fewer waves have none)."""
    return [u for per in ws.values() if w < len(per) for u in per[w]]
