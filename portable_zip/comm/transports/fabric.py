"""The C++ libfabric engine (transport/), behind the transport interface.
Python posts whole transfers and waits; chunking, rails, staging through
pinned host memory and the progress thread are C++. Sized: a coded stream
travels as one message whose length the engines learn from the codec's size
field. Settings (PZ_FABRIC_*, the same on every rank; the engine checks):
portable_zip/comm/settings.py."""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

import torch

import portable_zip._C as _C

from ... import codec
from ..settings import Settings
from .. import address
from ..deadline import Deadline
from ..errors import MismatchError, PeerError, PeerTimeout
from ..store import swap_through_store
from .base import RECV, RECV_SIZED, SEND, SEND_SIZED, Op, Transport, TransportCosts, as_bytes

_HOST = torch.device("cpu")
_KIND = {SEND: 0, RECV: 1, SEND_SIZED: 2, RECV_SIZED: 3}  # the engine's op codes
DRAIN_S = 5.0  # close(): how long credits due may take to arrive (push)
# Control (or spec) then one round per wave. Host time per exchange: a
# compressed 32-64 MiB send over tcp;ofi_rxm between two ranks on one H200
# took ~2 ms more than ratio x raw (16 MiB: 1.2 ms; h200-fabric-auto.json,
# d0bda34): the header read-back, the staging of the sized message's first
# chunk, and the stream's fewer chunks filling the rails less. With 0.9 ms
# auto compressed 32 MiB sends at 0.93x of raw. Collectives in one domain
# use the figure measured at construction instead (calibration.measure_exchange);
# point to point and mixed clusters keep this one.
FABRIC_COSTS = TransportCosts(coll_rounds=2, second_phase_rounds=1, host_exchange_s=2e-3)


def unavailable() -> str:
    """"" when this build has the engine and libfabric loads, else why not."""
    return _C.fabric_probe()


class FabricTransport(Transport):
    """Between the ranks of a Group (group.py); endpoint addresses are
    swapped through the job's store, so any job (gloo-only included) can use it."""
    sized = True
    costs = FABRIC_COSTS

    def __init__(self, group, device: torch.device, settings: Settings, same_host: bool, bind: Optional[str] = None):
        """bind: the address to listen on (address.py's choice); None: PZ_IFACE's, else libfabric's."""
        why = unavailable()
        if why:
            raise RuntimeError(f"transport='fabric' is unavailable: {why}")
        self.group = group
        self.rank, self.world = group.rank, group.size
        self.device = device
        if device.type == "cpu":
            os.environ.setdefault("FI_HMEM", "system")  # a CPU rank: libfabric leaves CUDA/ROCr alone
        else:
            codec.load_device_code()  # the engine's staging copies use the vendor runtime
        if bind is None:
            bind = address.iface_ip(settings.iface, settings.iface_var)[0] if settings.iface else ""
        if settings.port_range:  # read once per process, by libfabric's tcp provider (rxm's connections)
            os.environ.setdefault("FI_TCP_PORT_LOW_RANGE", str(settings.port_range[0]))
            os.environ.setdefault("FI_TCP_PORT_HIGH_RANGE", str(settings.port_range[1]))
        provider, rails, chunk, depth, stage, spin, window = settings.fabric()
        try:
            self.engine = _C.FabricEngine(provider, rails, chunk, depth, stage,
                                          device.index if device.type == "cuda" else -1, self.rank, self.world,
                                          same_host, spin, group.secret, bind if ":" not in bind else "", window)
        except RuntimeError as e:
            raise RuntimeError(f"transport='fabric': {e}") from None
        self.info = self.engine.info()
        self.name = f"libfabric/{self.info['provider']}"
        self.backend = "fabric"
        self._global = group.ranks
        self._cuda = device.type == "cuda"

    @property
    def ctrl_device(self) -> torch.device:
        return _HOST  # the engine moves host memory on every rank, GPU ranks included

    def global_rank(self, r: int) -> int:
        return self._global[r]

    def connect(self, deadline: Deadline) -> None:
        """Swap endpoint addresses through the job's store (the private group's
        name keys them, so Communicators never collide), then connect."""
        addrs = swap_through_store(self.group, "fabric", self.engine.address(), deadline, "its fabric address")
        try:
            self.engine.connect(addrs)
        except ValueError as e:
            raise MismatchError(str(e)) from None

    def post(self, ops: Sequence[Op]):
        """Tensors stay referenced until wait(): the engine holds raw pointers."""
        keep, desc = [], []
        for kind, t, peer in ops:  # empty ones too (the engine skips them): lens line up with ops
            b = as_bytes(t)
            keep.append(b)
            desc.append((_KIND[kind], peer, b.data_ptr(), b.numel(), b.is_cuda))
        if not desc:
            return None
        stream = torch.cuda.current_stream(self.device).cuda_stream if self._cuda else 0
        try:
            return self.engine.post(desc, stream), keep
        except RuntimeError as e:
            raise PeerError(f"{self.name}: {e}") from None

    def wait(self, pending, deadline: Deadline) -> List[int]:
        """Bytes each op moved (sized ones: the stream's length). Either error closes the engine."""
        if pending is None:
            return []
        batch, _keep = pending
        try:
            lens: Optional[List[int]] = self.engine.wait(batch, float(deadline.left()))
        except RuntimeError as e:
            raise PeerError(f"{self.name}: {e}") from None
        if lens is None:
            raise PeerTimeout(f"{self.name}: a peer did not answer within {deadline.timeout:g} s")
        return lens

    def abort(self, why: str) -> None:
        self.engine.abort(why)

    def drain(self) -> None:
        """Push: let the credits due for what this rank sent arrive (at most
        DRAIN_S; a peer that said goodbye owes none), so none is unread when
        the endpoints close (engine.h, drain)."""
        self.engine.drain(DRAIN_S)

    def close(self, drain: bool = True) -> None:
        if drain:
            self.drain()
        self.engine.close()
