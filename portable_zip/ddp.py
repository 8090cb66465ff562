"""A DDP communication hook: lossless compressed gradient all-reduce on
whatever backend the process group has.

    ddp.register_comm_hook(None, pz.ddp_comm_hook)     # the default group, compress="auto"
    state = pz.DDPHookState(group, compress="always")  # or a group and options of your own
    ddp.register_comm_hook(state, pz.ddp_comm_hook)

It is torch's allreduce_hook (default_hooks.py) with the all-reduce going
through a pz.Communicator: the bucket is divided by the group size first,
then summed, and the future's value is the bucket. The Communicator is
made at the first bucket, on the bucket's device: DDP calls the hook for
its first bucket on every rank, so that is collective.
"""
# No `from __future__ import annotations`: DDP compares the hook's annotations with the real types.
import threading
from typing import Optional

import torch
import torch.distributed as dist

from .c10d import TorchWork
from .comm import Communicator, Group, ReduceOp, check_options, group_for, reduction


class DDPHookState:
    """The state of pz.ddp_comm_hook: a pz.Communicator over process_group
    (default: the world), made at the hook's first bucket on the bucket's
    device (the model's), collectively: every rank's DDP calls the hook for
    its first bucket.

    compress: "auto" (the cost model picks torch's own all-reduce or the
    compressed one per bucket), "always" or "never"; the other options
    (max_sms, timeout, transport, device, link_gbps, ...) are
    pz.Communicator's."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, compress: str = "auto", **options):
        check_options(compress, options)
        self.process_group = process_group
        self.communicator: Optional[Communicator] = None  # made at the first bucket
        self._options = {"compress": compress, **options}
        self._own: Optional[Group] = None  # a group made for the Communicator (group_for), closed with it
        self._lock = threading.Lock()

    def communicator_for(self, device: torch.device) -> Communicator:
        """The Communicator, made now (collectively) on device if this is the first bucket."""
        with self._lock:
            if self.communicator is None:
                opts = {"device": device, **self._options}
                group = self.process_group if self.process_group is not None else dist.group.WORLD
                parent = group_for(group, torch.device(opts["device"]), opts.get("timeout"))
                self._own = parent if parent is not group else None
                try:
                    self.communicator = Communicator(parent, **opts)
                except BaseException:
                    self._close_own()
                    raise
            return self.communicator

    @property
    def stats(self) -> dict:
        return self.communicator.stats if self.communicator is not None else {}

    def close(self) -> None:
        """Finish queued ops and release the Communicator (a later bucket makes a new one, collectively)."""
        with self._lock:
            comm, self.communicator = self.communicator, None
        try:
            if comm is not None:
                comm.close()
        finally:
            self._close_own()

    def _close_own(self) -> None:
        own, self._own = self._own, None
        if own is not None:
            own.close()


_defaults: dict = {}  # the default group -> the DDPHookState that state None stands for
_defaults_lock = threading.Lock()


def _default_state() -> DDPHookState:
    """state None: the default group's state, with the default options. A
    new default group (after destroy_process_group) gets a new one."""
    world, stale = dist.group.WORLD, []
    with _defaults_lock:
        state = _defaults.get(world)
        if state is None:
            stale = list(_defaults.values())
            _defaults.clear()
            state = _defaults[world] = DDPHookState()
    for s in stale:
        s.close()  # their world is gone, and with it their DDP model
    return state


def ddp_comm_hook(state: Optional[DDPHookState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group, as torch's allreduce_hook does
    (divide by the group size, then sum), through state's Communicator;
    state None: the default group's, with compress="auto" (as torch's hooks
    take None for the default group).

    The sum runs in rank order, accumulating in fp32 (fp64 for fp64) with one
    rounding, so every rank and every compress mode ends with the same bits;
    these equal torch's where torch's order gives the same sum (two ranks)."""
    if state is not None and not isinstance(state, DDPHookState):
        raise TypeError(f"pz.ddp_comm_hook's state must be a pz.DDPHookState or None (the default group), "
                        f"got {type(state).__name__}")
    buf = bucket.buffer()
    reduction(dist.ReduceOp.SUM, buf.dtype, "pz.ddp_comm_hook all_reduce")
    comm = (state if state is not None else _default_state()).communicator_for(buf.device)
    buf.div_(comm.world)  # first, as allreduce_hook does: no overflow in fp16
    work = comm.all_reduce(buf, op=ReduceOp.SUM, async_op=True)
    return TorchWork([work], [buf]).get_future().then(lambda fut: fut.value()[0])


__all__ = ["DDPHookState", "ddp_comm_hook"]
