"""The transport interface: everything the pipeline, the collectives and the
Communicator ask of a way to move bytes between the ranks of a group.

A transport posts transfers and waits for them. The pipeline (pipeline.py)
runs every exchange over this interface alone; it asks `sized` whether the
transport can carry a coded stream as one message whose length travels with
it (the fabric engine reads it from the stream's size field on the sender's
device and from the first chunk on the receiver's), and otherwise moves a
stream's fixed-size parts and its tail in two rounds."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..deadline import Deadline

# Op kinds. SEND_SIZED / RECV_SIZED only where Transport.sized: the receive
# buffer is the stream's capacity, and wait() returns the bytes that arrived.
SEND, RECV, SEND_SIZED, RECV_SIZED = "send", "recv", "send_sized", "recv_sized"
Op = Tuple[str, torch.Tensor, int]  # (kind, contiguous tensor, peer rank in the group)


@dataclass(frozen=True)
class TransportCosts:
    """What a compressed exchange costs beyond its bytes (the policy reads
    it): latency rounds of a collective's first phase and of all_reduce's
    second, and host time per exchange and per wave. Point to point has no
    round of its own: a message's frame travels with its payload, raw or
    coded alike (comm/p2p.py). Host time
    from PZ_TRACE timelines on H200 (docs/COMM.md); alpha, measured with the
    same post-and-wait, already holds most of it."""
    coll_rounds: int = 3        # spec, fixed parts, tails
    second_phase_rounds: int = 2
    host_exchange_s: float = 200e-6
    host_wave_s: float = 100e-6


class Transport(abc.ABC):
    """name: for messages ("torch.distributed/gloo", "libfabric/tcp;ofi_rxm").
    backend: "nccl", "gloo", "fabric" or "routed". rank, world: in the group.
    device: the tensors it moves. sized: carries SEND_SIZED/RECV_SIZED.
    costs: for the policy. local: the native torch transport of this rank's
    domain, for the native collectives of hierarchical algorithms (None where
    there is none: a fabric-only rank)."""
    name: str
    backend: str
    rank: int
    world: int
    device: torch.device
    sized: bool = False
    costs: TransportCosts = TransportCosts()
    local: Optional["Transport"] = None
    # The liveness watch (comm/liveness.py) its waits check, set at
    # construction; close() closes it (closing twice is harmless).
    watch = None

    @property
    def ctrl_device(self) -> torch.device:
        """Where the agreement rule's small messages live: the data's device,
        unless the transport moves host memory itself (then no copy to the
        GPU to send one, and no wait on the GPU's queue to read one)."""
        return self.device

    @abc.abstractmethod
    def global_rank(self, r: int) -> int:
        """The global rank of group rank r."""

    def connect(self, deadline: Deadline) -> None:
        """Collective, at construction: set up every pair now, with all ranks present."""

    @abc.abstractmethod
    def post(self, ops: Sequence[Op]) -> object:
        """Queue transfers (empty tensors are skipped); returns what wait() takes.
        Transfers to one peer match the peer's in posting order."""

    @abc.abstractmethod
    def wait(self, pending: object, deadline: Deadline) -> Optional[List[int]]:
        """Until posted transfers are done. Returns the bytes each op moved
        where the transport is sized, else None. PeerTimeout past the
        deadline; PeerError when a transfer fails."""

    def abort(self, why: str) -> None:
        """Cancel what is posted before the caller's buffers are freed (an
        exchange failed with transfers in flight). Transports whose pending
        transfers hold their tensors need nothing."""

    def close(self) -> None:
        """Release endpoints and threads; later posts fail."""
        self.close_watch()

    def close_watch(self) -> None:
        """Goodbye to the peers (an orderly close is no death), the watch's thread and sockets released."""
        w, self.watch = self.watch, None
        if w is not None:
            w.close()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor: every backend moves every dtype."""
    if not t.numel():  # an empty tensor may carry any stride (numpy's have 0), which view() rejects
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)
