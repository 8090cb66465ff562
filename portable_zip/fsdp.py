"""FSDP2 communication hooks: lossless compressed all-gather and
reduce-scatter on whatever backend the process group has (NCCL, RCCL, gloo).

    m.set_custom_all_gather(pz.fsdp.AllGather())
    m.set_custom_reduce_scatter(pz.fsdp.ReduceScatter())

Each hook keeps one pz.Communicator per process group it is called with,
made at its first call there. That is collective over the group, and safe,
because FSDP2 calls a unit's hooks on every rank of its group in one order.
The Communicators live as long as the hook (close() releases them sooner):
a Communicator holds its group, so a group the hook still caches stays alive.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.distributed as dist

from .c10d import TorchWork
from .comm import Communicator, check_options, group_for, merged as merged_stats, premultiplied, reduction

class _Hook:
    """What both hooks share: options for pz.Communicator, a Communicator per
    group (made at the first call with that group), FSDP2's allocate. FSDP2's
    protocol classes (torch.distributed.fsdp._fully_shard._fsdp_api) are not
    base classes here: FSDP2 only calls allocate and __call__, and importing
    torch.distributed.fsdp would add ~1 s to `import portable_zip`."""

    def __init__(self, compress: str = "auto", **options):
        check_options(compress, options)
        self._options = {"compress": compress, **options}
        self._comms: "weakref.WeakKeyDictionary[dist.ProcessGroup, Communicator]" = weakref.WeakKeyDictionary()
        self._own: list = []  # groups made for them (comm.setup.group_for), closed with them

    def communicator(self, group: dist.ProcessGroup, device: torch.device) -> Communicator:
        """The Communicator of group (made now, collectively, if this is the first call with it)."""
        group = group if group is not None else dist.group.WORLD
        c = self._comms.get(group)
        if c is None:
            # A group whose backend cannot move device's tensors (a pz group's NCCL under a CPU model)
            # gets one of its ranks that can, closed with the Communicator.
            parent = group_for(group, torch.device(device), self._options.get("timeout"))
            try:
                c = Communicator(parent, **{"device": device, **self._options})
            except BaseException:
                if parent is not group:
                    parent.close()
                raise
            self._comms[group] = c
            if parent is not group:
                self._own.append(parent)
        return c

    @property
    def stats(self) -> dict:
        """Communicator.stats of this hook's Communicators, summed per op."""
        return merged_stats(c.stats for c in list(self._comms.values()))

    def close(self) -> None:
        """Finish queued ops and release every Communicator (a later call makes a new one, collectively)."""
        comms, self._comms = list(self._comms.values()), weakref.WeakKeyDictionary()
        own, self._own = self._own, []
        try:
            for c in comms:
                c.close()
        finally:
            for g in own:
                g.close()

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @staticmethod
    def _handle(work, out: torch.Tensor, async_op: bool):
        # FSDP2 waits only on a torch.distributed Work (isinstance check), ordering its stream after the op's.
        return TorchWork([work], [out]) if async_op else None

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return f"pz.fsdp.{type(self).__name__}({opts})"


class AllGather(_Hook):
    """FSDP2's parameter all-gather through pz.Communicator.all_gather_single.

    compress: "auto" (the cost model picks torch's own op or the compressed
    one per call), "always", "never"; the other options (max_sms, timeout,
    transport, link_gbps, ...) are pz.Communicator's. Parameters of mixed
    dtypes reach the hook as one uint8 buffer, which moves as raw bytes: the
    hook cannot see where each dtype's segment lies, and coding bf16 bits as
    another type would not compress them."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        work = self.communicator(group, output_tensor.device).all_gather_single(output_tensor, input_tensor,
                                                                               async_op=async_op)
        return self._handle(work, output_tensor, async_op)


class ReduceScatter(_Hook):
    """FSDP2's gradient reduce-scatter through pz.Communicator.reduce_scatter_single.

    Ops: SUM, AVG, MIN, MAX, and PREMUL_SUM (FSDP2's gradient divide
    factor), which premultiplies each rank's input as NCCL does and sums.
    Sums are reduced in rank order, accumulating in fp32 (fp64 for fp64)
    with one rounding, so every rank and every compress mode ends with the
    same bits; these equal torch's where torch's order gives the same sum
    (two ranks: a + b), and otherwise differ from NCCL's ring or tree order
    by rounding. Other ops or dtypes raise, naming both."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        red, factor = reduction(op, input_tensor.dtype, "pz.fsdp.ReduceScatter")
        if factor is not None:
            input_tensor = premultiplied(input_tensor, factor)
        work = self.communicator(group, output_tensor.device).reduce_scatter_single(
            output_tensor, input_tensor, op=red, async_op=async_op)
        return self._handle(work, output_tensor, async_op)


__all__ = ["AllGather", "ReduceScatter"]
