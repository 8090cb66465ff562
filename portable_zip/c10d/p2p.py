"""Point to point for the pz backend, on the one point-to-point path
(portable_zip.comm.PointToPoint): each send meets the peer's recv in
posting order per (source, destination, tag), whatever either side batches
or waits on (pipeline schedules post sends in one batch and receive them one
at a time). Every message carries its dtype, size and plan, so a recv of
another size or dtype raises MismatchError on both ranks, in every mode."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..comm import PointToPoint, TorchDistTransport, Work
from . import torch_work


class P2P:
    """One device kind's point to point over its own groups (the inner
    backend's kind: gloo, or NCCL with a group per direction). compresses(t):
    the sender's plan for t. Payloads travel on the groups' device: host
    memory when GPU ranks have no NCCL (two ranks on one GPU)."""

    def __init__(self, groups: tuple, compresses: Callable[[torch.Tensor], bool], timeout: float,
                 max_sms: int = 0):
        self.groups = groups
        tps = tuple(TorchDistTransport(g) for g in groups)
        self.path = PointToPoint(tps if len(tps) == 2 else (tps[0], tps[0]), lambda t, peer: compresses(t),
                                 timeout, max_sms=max_sms or None)
        self._tps = tps

    @property
    def stats(self):
        return self.path.stats

    def send(self, t: torch.Tensor, peer: int, tag: int = 0):
        return torch_work.TorchWork([Work(self.path.isend(t, peer, tag))], [t])

    def recv(self, t: torch.Tensor, peer: int, tag: int = 0):
        return torch_work.TorchWork([Work(self.path.irecv(t, peer, tag))], [t])

    def close(self, why: Optional[str] = None) -> None:
        """Fail what still waits, then release the groups."""
        try:
            self.path.close(why or "the pz process group was shut down")
        finally:
            for tp in self._tps:
                tp.close()
