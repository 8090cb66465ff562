"""Point to point over a Group (group.py): NCCL on CUDA, RCCL on ROCm
(torch's "nccl" backend), gloo on CPU."""
from __future__ import annotations

import datetime
import threading
import time
from typing import List, Sequence

import torch

from ..deadline import Deadline
from ..errors import PeerError, PeerTimeout
from .base import RECV, SEND, Op, Transport, as_bytes

_NCCL_MOVES = frozenset((torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
                         torch.int32, torch.int64))
# What each backend moves as it is (gloo also rejects int16 and fp8).
_MOVES = {"nccl": _NCCL_MOVES, "gloo": _NCCL_MOVES | {torch.bool}}
_NOTHING: frozenset = frozenset()


def movable(t: torch.Tensor, backend: str) -> torch.Tensor:
    """t itself where the backend moves its dtype, else its uint8 view: a
    fresh view costs a small collective ~5-15 µs of host time (measured on
    gloo), more than the rest of the native plan's checks."""
    if t.dtype in _MOVES.get(backend, _NOTHING):
        return t if t.dim() == 1 else t.reshape(-1)
    return as_bytes(t)


def failed(name: str, e: RuntimeError, timeout: float) -> Exception:
    """torch.distributed's error as ours: PeerTimeout when it timed out, else PeerError."""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "timed out" in msg.lower() or "timeout" in msg.lower():
        return PeerTimeout(f"{name}: a peer did not answer within {timeout:g} s ({msg})")
    return PeerError(f"{name}: transfer failed, peer likely dead ({msg})")


class TorchDistTransport(Transport):
    """Unsized: the pipeline moves a stream's fixed parts, then its tail.
    Its own native collectives run on `group` (local is itself)."""

    def __init__(self, group):
        self.group = group
        self.backend = group.backend
        self.rank, self.world, self.device = group.rank, group.size, group.device
        self.name = f"torch.distributed/{self.backend}"
        self.local = self
        self._global = group.ranks
        self._gloo = self.backend == "gloo"

    def global_rank(self, r: int) -> int:
        return self._global[r]

    def close(self) -> None:
        self.group.close()

    def connect(self, deadline: Deadline) -> None:
        """Create the group's NCCL communicator now, with all ranks present:
        NCCL builds it lazily and that set-up blocks the host, so a first send
        to a silent peer could otherwise hang past any timeout."""
        if self.world == 1 or self.backend != "nccl":
            return
        one = torch.zeros(1, dtype=torch.uint8, device=self.device)
        bufs = {p: torch.empty_like(one) for p in range(self.world) if p != self.rank}
        self.wait(self.post([(SEND, one, p) for p in bufs] + [(RECV, b, p) for p, b in bufs.items()]), deadline)

    def post(self, ops: Sequence[Op]) -> List[object]:
        ops = [(kind, t, peer) for kind, t, peer in ops if t.numel()]
        if not ops:
            return []
        try:
            # On NCCL every post is a batch (Group.send_recv): a lone
            # isend/irecv runs on the pair's own communicator, and a send
            # posted alone on one side but in a batch on the other (3+ ranks:
            # the other side's wave holds more peers) would never match.
            return self.group.send_recv([(kind == SEND, movable(t, self.backend), peer) for kind, t, peer in ops])
        except RuntimeError as e:
            raise PeerError(f"{self.name}: posting {len(ops)} transfers failed: {e}") from e

    def wait(self, works: List[object], deadline: Deadline) -> None:
        for w in works:
            try:
                if self._gloo:
                    w.wait(datetime.timedelta(seconds=deadline.left()))
                    continue
                # NCCL: wait() only orders streams, so poll completion for the
                # deadline: spin first (a sleep costs ~60 us, more than a small
                # transfer), then back off.
                spin_until = time.monotonic() + 0.005
                while not w.is_completed():
                    now = time.monotonic()
                    if now > deadline.at:
                        raise PeerTimeout(f"{self.name}: a peer did not answer within {deadline.timeout:g} s")
                    if now > spin_until:
                        time.sleep(50e-6)
                w.wait()
            except PeerError:
                raise
            except RuntimeError as e:
                raise failed(self.name, e, deadline.timeout) from e

    def wait_detached(self, works: List[object], deadline: Deadline) -> None:
        """wait() for works whose own wait ignores its timeout (gloo's
        reduce_scatter blocks until the peer answers or dies): a helper thread
        waits, this one gives up at the deadline. The group is unusable after
        a timeout anyway, so the stuck helper is left to torch's own timeout."""
        if not self._gloo:
            return self.wait(works, deadline)
        done, box = threading.Event(), []

        def run():
            try:
                self.wait(works, deadline)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box.append(e)
            done.set()

        threading.Thread(target=run, name="pz-wait", daemon=True).start()
        if not done.wait(deadline.left()):
            raise PeerTimeout(f"{self.name}: a peer did not answer within {deadline.timeout:g} s")
        if box:
            raise box[0]
