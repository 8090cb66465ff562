"""What the weight-sync engine needs from the rest of the package: the
delta codec when it is present, one checksum, and a JSON all_gather over a
Communicator (the manifests and the per-bucket status)."""
from __future__ import annotations

import importlib
import json

import torch

from .. import codec



def delta_codec():
    """portable_zip.delta, or None where this build has no delta codec."""
    try:
        return importlib.import_module("portable_zip.delta")
    except ImportError:
        return None


def checksum(t: torch.Tensor) -> int:
    """A 64-bit checksum of a contiguous tensor's bytes, the same on CPU and GPU, as a signed int64."""
    return _signed(_checksum(t))


def stream_checksum(stream: torch.Tensor, target) -> int:
    """The target checksum a delta stream's header carries (signed), or target's own where the codec has no inspect."""
    d = delta_codec()
    if hasattr(d, "inspect"):
        try:
            return _signed(int(d.inspect(stream)["target_checksum"]))
        except Exception:  # noqa: BLE001 - a damaged header: the checksum below decides
            pass
    return checksum(target) if target is not None else 0


def _signed(h: int) -> int:
    h &= 2**64 - 1
    return h - 2**64 if h >= 2**63 else h


def _checksum(t: torch.Tensor) -> int:
    d = delta_codec()
    if d is not None:
        return int(d.checksum(t))
    # Without the delta codec: the xor and the wrapping sum of the bytes as
    # 8-byte words (order-blind; the codec's own checks guard the full path).
    b = t.reshape(-1).view(torch.uint8)
    if b.numel() % 8:
        b = torch.cat([b, b.new_zeros(8 - b.numel() % 8)])
    if not b.numel():
        return 0
    w = b.view(torch.int64)
    x = int(torch.hash_tensor(w).view(torch.int64))
    return x ^ (int(w.sum()) * 0x9E3779B97F4A7C15)


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
