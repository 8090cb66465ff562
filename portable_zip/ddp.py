"""A DDP communication hook: lossless compressed gradient all-reduce on
whatever backend the process group has.

    state = pz.DDPHookState()                   # on every rank, together
    ddp.register_comm_hook(state, pz.ddp_comm_hook)

It is torch's allreduce_hook (default_hooks.py) with the all-reduce going
through a pz.Communicator: the bucket is divided by the group size first,
then summed, and the future's value is the bucket.
"""
# No `from __future__ import annotations`: DDP compares the hook's annotations with the real types.
from typing import Optional

import torch
import torch.distributed as dist

from .c10d.works import Work as _TorchWork
from .comm import Communicator, ReduceOp
from .fsdp import check_options, reduction


class DDPHookState:
    """The state of pz.ddp_comm_hook: a pz.Communicator over process_group
    (default: the world). Making it is collective over the group: every rank
    makes its state together, before training.

    compress: "auto" (the cost model picks torch's own all-reduce or the
    compressed one per bucket), "always" or "never"; the other options
    (max_sms, timeout, transport, device, link_gbps, ...) are
    pz.Communicator's."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, compress: str = "auto", **options):
        check_options(compress, options)
        self.process_group = process_group
        self.communicator = Communicator(process_group, compress=compress, **options)

    @property
    def stats(self) -> dict:
        return self.communicator.stats

    def close(self) -> None:
        self.communicator.close()


def ddp_comm_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group, as torch's allreduce_hook does
    (divide by the group size, then sum), through state's Communicator.

    The sum runs in rank order, accumulating in fp32 (fp64 for fp64) with one
    rounding, so every rank and every compress mode ends with the same bits;
    these equal torch's where torch's order gives the same sum (two ranks)."""
    if not isinstance(state, DDPHookState):
        raise TypeError(f"pz.ddp_comm_hook's state must be a pz.DDPHookState (made on every rank before "
                        f"training), got {type(state).__name__}")
    buf = bucket.buffer()
    reduction(dist.ReduceOp.SUM, buf.dtype, "pz.ddp_comm_hook all_reduce")
    comm = state.communicator
    buf.div_(comm.world)  # first, as allreduce_hook does: no overflow in fp16
    work = comm.all_reduce(buf, op=ReduceOp.SUM, async_op=True)
    return _TorchWork([work], [buf]).get_future().then(lambda fut: fut.value()[0])


__all__ = ["DDPHookState", "ddp_comm_hook"]
