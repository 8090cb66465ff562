"""What the weight-sync engine needs from the rest of the package: one
checksum, a delta stream's target checksum, and a JSON all_gather over a
Communicator (the manifests and the per-bucket status)."""
from __future__ import annotations

import json
from typing import Optional

import torch

from .. import codec
from ..codec import delta


def checksum(t: torch.Tensor) -> int:
    """A 64-bit checksum of a contiguous tensor's bytes, the same on CPU and GPU, as a signed int64."""
    return _signed(int(delta.checksum(t)))


def stream_checksum(stream: torch.Tensor) -> Optional[int]:
    """The target checksum a delta stream's header carries (signed); None
    where the header is damaged (the rebuilt tensor's own checksum decides)."""
    try:
        return _signed(int(delta.inspect(stream)["target_checksum"]))
    except ValueError:  # FormatError: a damaged header
        return None


def _signed(h: int) -> int:
    h &= 2**64 - 1
    return h - 2**64 if h >= 2**63 else h


def gather(comm, obj) -> list:
    """Every rank's `obj` (JSON), in rank order, on every rank: two all_gathers."""
    raw = json.dumps(obj, separators=(",", ":")).encode()
    n = torch.tensor([len(raw)], dtype=torch.int64, device=comm.device)
    ns = torch.empty(comm.world, dtype=torch.int64, device=comm.device)
    comm.all_gather_single(ns, n)
    sizes = ns.tolist()
    top = max(sizes)
    buf = torch.zeros(top, dtype=torch.uint8)
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else buf[:0]
    out = torch.empty(comm.world * top, dtype=torch.uint8, device=comm.device)
    comm.all_gather_single(out, buf.to(comm.device))
    rows = out.cpu().view(comm.world, top) if top else out.cpu().view(comm.world, 0)
    return [json.loads(bytes(rows[r, :sizes[r]].numpy())) for r in range(comm.world)]


def pinned_if_cuda(like: torch.Tensor) -> torch.Tensor:
    """A host buffer shaped like `like`, pinned when CUDA is present (fast copies both ways)."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=torch.cuda.is_available() and like.is_cuda)


FormatError = codec.FormatError
