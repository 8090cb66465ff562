"""transport="fabric": the C++ libfabric engine (transport/), behind the same
seam as torch.distributed. Python posts whole transfers and waits; chunking,
rails, staging through pinned host memory and the progress thread are C++.

Settings (libfabric style, the same on every rank; the engine checks):
PZ_FABRIC_PROVIDER (force one: "tcp;ofi_rxm", "efa", "shm", ...),
PZ_FABRIC_RAILS (endpoints per peer, default 2), PZ_FABRIC_CHUNK (bytes per
chunk and staging slot, default 2 MiB), PZ_FABRIC_DEPTH (chunks in flight per
peer and direction, default max(4, 2 x rails)), PZ_FABRIC_STAGE=1 (stage host memory too),
PZ_FABRIC_LIBRARY (a libfabric.so.1 to load), PZ_FABRIC_SPIN (idle polls
before the progress thread sleeps, default 2000; more on dedicated cores)."""
from __future__ import annotations

import os
from typing import List, Sequence

import torch
import torch.distributed as dist

from .. import _C, _device
from .errors import MismatchError, PeerError, PeerTimeout
from .policy import FABRIC_COSTS
from .transport import Op, as_bytes, swap_through_store

SEND, RECV, SEND_SIZED, RECV_SIZED = 0, 1, 2, 3


def available() -> str:
    """"" when this build has the engine and libfabric loads, else why not."""
    return _C.fabric_probe()


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    try:
        return int(v) if v else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {v!r}") from None


class FabricTransport:
    """Point-to-point over libfabric between the ranks of a torch.distributed
    group; endpoint addresses are swapped through the job's store, so any
    job (gloo-only included) can use it."""

    def __init__(self, group, device: torch.device, timeout: float, same_host: bool):
        why = available()
        if why:
            raise RuntimeError(f"transport='fabric' is unavailable: {why}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        if device.type == "cpu":
            os.environ.setdefault("FI_HMEM", "system")  # a CPU rank: libfabric leaves CUDA/ROCr alone
        else:
            _device.require()  # the engine's staging copies use the vendor runtime
        provider = os.environ.get("PZ_FABRIC_PROVIDER", "")
        try:
            rails = _env_int("PZ_FABRIC_RAILS", 2)
            self.engine = _C.FabricEngine(provider, rails, _env_int("PZ_FABRIC_CHUNK", 2 << 20),
                                          _env_int("PZ_FABRIC_DEPTH", max(4, 2 * rails)),
                                          os.environ.get("PZ_FABRIC_STAGE") == "1",
                                          device.index if device.type == "cuda" else -1, self.rank, self.world,
                                          same_host, _env_int("PZ_FABRIC_SPIN", 2000))
        except RuntimeError as e:
            raise RuntimeError(f"transport='fabric': {e}") from None
        self.info = self.engine.info()
        self.name = f"libfabric/{self.info['provider']}"
        self.backend = "fabric"
        self.costs = FABRIC_COSTS
        self._timeout = timeout
        self._stream = (lambda: torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else (lambda: 0)

    def global_rank(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not dist.group.WORLD else r

    def connect(self, timeout: float) -> None:
        """Swap endpoint addresses through the job's store (the private group's
        name keys them, so Communicators never collide), then connect."""
        addrs = swap_through_store(self.group, "fabric", self.engine.address(), timeout, "its fabric address")
        try:
            self.engine.connect(addrs)
        except ValueError as e:
            raise MismatchError(str(e)) from None

    def post(self, ops: Sequence[Op]):
        """Queue transfers; returns what wait() takes. Tensors stay referenced until then."""
        return self.post_raw([(SEND if kind == "send" else RECV, t, peer) for kind, t, peer in ops])

    def post_raw(self, ops: List[tuple]):
        keep, desc = [], []
        for kind, t, peer in ops:  # empty ones too (the engine skips them): lens line up with ops
            b = as_bytes(t)
            keep.append(b)
            desc.append((kind, peer, b.data_ptr(), b.numel(), b.is_cuda))
        if not desc:
            return None
        try:
            return self.engine.post(desc, self._stream()), keep
        except RuntimeError as e:
            raise PeerError(f"{self.name}: {e}") from None

    def wait(self, pending, timeout: float) -> List[int]:
        """Bytes each op moved (sized ones: the stream's length); PeerTimeout
        past timeout, PeerError on a transfer error. Either closes the engine."""
        if pending is None:
            return []
        batch, _keep = pending
        try:
            lens = self.engine.wait(batch, float(timeout))
        except RuntimeError as e:
            raise PeerError(f"{self.name}: {e}") from None
        if lens is None:
            raise PeerTimeout(f"{self.name}: a peer did not answer within {timeout:g} s")
        return lens

    def abort(self, why: str) -> None:
        """Cancel every posted transfer (an exchange failed with some still in
        flight) before the caller's buffers are freed; the engine closes."""
        self.engine.abort(why)

    def exchange(self, sends, recvs, plan, timeout: float):
        from .wire import exchange_sized
        return exchange_sized(self, sends, recvs, plan, timeout)

    def close(self) -> None:
        self.engine.close()

