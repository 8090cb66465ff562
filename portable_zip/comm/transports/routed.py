"""Mixed clusters: peers of this rank's domain over its native torch
transport, every other peer over the fabric engine; the pipeline and the
collectives see one (unsized) transport."""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..deadline import Deadline
from .base import Op, Transport
from .fabric import FabricTransport
from .torch import TorchDistTransport


class RoutedTransport(Transport):
    backend = "routed"

    def __init__(self, local: Optional[TorchDistTransport], members: List[int], fabric: FabricTransport):
        self.local, self.fabric = local, fabric
        self.rank, self.world, self.device = fabric.rank, fabric.world, fabric.device
        self._local_of = {r: i for i, r in enumerate(members)}  # group rank -> rank in the domain's group
        self.name = f"{local.name if local else 'alone'} + {fabric.name}"

    def global_rank(self, r: int) -> int:
        return self.fabric.global_rank(r)

    def connect(self, deadline: Deadline) -> None:
        self.fabric.connect(deadline)
        if self.local is not None:
            self.local.connect(deadline)

    def post(self, ops: Sequence[Op]):
        near = [(k, t, self._local_of[p]) for k, t, p in ops if p in self._local_of]
        far = [(k, t, p) for k, t, p in ops if p not in self._local_of]
        return (self.local.post(near) if near else None, self.fabric.post(far) if far else None)

    def wait(self, pending, deadline: Deadline) -> None:
        near, far = pending
        if far is not None:
            self.fabric.wait(far, deadline)
        if near is not None:
            self.local.wait(near, deadline)

    def abort(self, why: str) -> None:
        self.fabric.abort(why)

    def close(self) -> None:
        self.fabric.close()
        if self.local is not None:
            self.local.close()
