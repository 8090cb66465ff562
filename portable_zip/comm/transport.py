"""The transport seam: exchange(sends, recvs, plan, timeout) moves a set of
pairwise transfers, compressed or raw; post/wait move plain buffers (control
messages, calibration). torch.distributed's exchange is the Python wave
protocol (wire.exchange); the fabric engine's runs its pipeline in C++
(fabric.py)."""
from __future__ import annotations

import datetime
import threading
import time
from typing import List, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from .errors import PeerError, PeerTimeout

Op = Tuple[str, torch.Tensor, int]  # ("send" | "recv", contiguous tensor, peer rank in the group)


class Transport(Protocol):
    name: str
    rank: int
    world: int
    device: torch.device

    def post(self, ops: Sequence[Op]) -> object: ...

    def wait(self, pending: object, timeout: float) -> None: ...

    def exchange(self, sends, recvs, plan, timeout: float): ...


def swap_through_store(group, topic: str, value, timeout: float, what: str) -> List[bytes]:
    """Every rank's value (str or bytes) in group-rank order, swapped through
    the job's store under the group's unique name, so any job (gloo-only
    included) can rendezvous; a rank silent past timeout raises PeerTimeout."""
    store = dist.distributed_c10d._get_default_store()
    prefix = f"pz/{topic}/{group.group_name}/"
    store.set(prefix + str(dist.get_rank(group)), value)
    keys = [prefix + str(j) for j in range(dist.get_world_size(group))]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
        values = [store.get(k) for k in keys]
        # The store lives in global rank 0, which leaves only once every member
        # has read: a rank that raises on what it read (a mismatch) and exits
        # must not take the store down under a peer still reading.
        store.set(prefix + "read/" + str(dist.get_rank(group)), "1")
        if dist.get_rank() == 0:
            store.wait([prefix + "read/" + str(j) for j in range(dist.get_world_size(group))],
                       datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - the store's timeout error type varies by torch version
        raise PeerTimeout(f"a peer did not publish {what} within {timeout:g} s ({e})") from None
    return values


def new_group_bounded(ranks: List[int], backend, timeout: float, who: str):
    """dist.new_group of global ranks (only they call it), with timeout as the
    group's own, so gloo's ops and NCCL's watchdog give up when we do; a member
    that never arrives raises PeerTimeout naming who was waited for."""
    try:
        return dist.new_group(ranks=ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout),
                              use_local_synchronization=True)
    except RuntimeError as e:  # the store's wait (DistStoreError) when a member never constructs
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            raise PeerTimeout(f"{who} did not construct its Communicator within {timeout:g} s") from e
        raise


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor: every backend moves every dtype."""
    if not t.numel():  # an empty tensor may carry any stride (numpy's have 0), which view() rejects
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)


_NCCL_NATIVE = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int32,
                torch.int64)


def movable(t: torch.Tensor, backend: str) -> torch.Tensor:
    """t itself where the backend moves its dtype (NCCL: all but fp8), else its
    uint8 view; skipping the view saves host time on small transfers."""
    if backend == "nccl" and t.dtype in _NCCL_NATIVE:
        return t if t.dim() == 1 else t.reshape(-1)
    return as_bytes(t)


class TorchDistTransport:
    """Point-to-point over an initialized torch.distributed group: NCCL on
    CUDA, RCCL on ROCm (torch's "nccl" backend), gloo on CPU."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.backend = str(dist.get_backend(self.group))
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.name = f"torch.distributed/{self.backend}"
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._global = [dist.get_global_rank(self.group, r) if self.group is not dist.group.WORLD else r
                        for r in range(self.world)]

    def global_rank(self, r: int) -> int:
        return self._global[r]

    def connect(self, timeout: float) -> None:
        """Create the group's NCCL communicator now, with all ranks present:
        NCCL builds it lazily and that set-up blocks the host, so a first send
        to a silent peer could otherwise hang past any timeout."""
        if self.world == 1 or self.backend != "nccl":
            return
        one = torch.zeros(1, dtype=torch.uint8, device=self.device)
        bufs = {p: torch.empty_like(one) for p in range(self.world) if p != self.rank}
        self.wait(self.post([("send", one, p) for p in bufs] + [("recv", b, p) for p, b in bufs.items()]), timeout)

    def post(self, ops: Sequence[Op]) -> List[object]:
        ops = [(kind, t, peer) for kind, t, peer in ops if t.numel()]
        if not ops:
            return []
        try:
            # On NCCL every post is a batch: a lone isend/irecv runs on the
            # pair's own communicator, and a send posted alone on one side but
            # in a batch on the other (3+ ranks: the other side's wave holds
            # more peers) would never match. gloo has one channel per pair.
            if len(ops) == 1 and self.backend != "nccl":
                kind, t, peer = ops[0]
                fn = dist.isend if kind == "send" else dist.irecv
                return [fn(movable(t, self.backend), self.global_rank(peer), group=self.group)]
            return dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv,
                                                      movable(t, self.backend),
                                                      self.global_rank(peer), self.group) for kind, t, peer in ops])
        except RuntimeError as e:
            raise PeerError(f"{self.name}: posting {len(ops)} transfers failed: {e}") from e

    def exchange(self, sends, recvs, plan, timeout: float):
        """The seam: the wire protocol's wave pipeline over post/wait."""
        from .wire import exchange
        return exchange(self, sends, recvs, plan, timeout)

    def wait_detached(self, works: List[object], timeout: float) -> None:
        """wait() for works whose own wait ignores its timeout (gloo's
        reduce_scatter blocks until the peer answers or dies): a helper thread
        waits, this one gives up at the deadline. The group is unusable after
        a timeout anyway, so the stuck helper is left to torch's own timeout."""
        done, box = threading.Event(), []

        def run():
            try:
                self.wait(works, timeout)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box.append(e)
            done.set()

        threading.Thread(target=run, name="pz-wait", daemon=True).start()
        if not done.wait(timeout):
            raise PeerTimeout(f"{self.name}: a peer did not answer within {timeout:g} s")
        if box:
            raise box[0]

    def wait(self, works: List[object], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for w in works:
            try:
                if self.backend == "gloo":
                    left = max(deadline - time.monotonic(), 0.001)
                    w.wait(datetime.timedelta(seconds=left))
                    continue
                # NCCL: wait() only orders streams, so poll completion for the
                # deadline: spin first (a sleep costs ~60 us, more than a small
                # transfer), then back off.
                spin_until = time.monotonic() + 0.005
                while not w.is_completed():
                    now = time.monotonic()
                    if now > deadline:
                        raise PeerTimeout(f"{self.name}: a peer did not answer within {timeout:g} s")
                    if now > spin_until:
                        time.sleep(50e-6)
                w.wait()
            except PeerError:
                raise
            except RuntimeError as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                if "timed out" in msg.lower() or "timeout" in msg.lower():
                    raise PeerTimeout(f"{self.name}: a peer did not answer within {timeout:g} s ({msg})") from e
                raise PeerError(f"{self.name}: transfer failed, peer likely dead ({msg})") from e
