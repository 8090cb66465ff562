"""torch.distributed groups and the job's store, bounded by a deadline:
what construction needs before any transport exists."""
from __future__ import annotations

import datetime
from typing import List

import torch.distributed as dist

from .deadline import Deadline
from .errors import PeerTimeout


def swap_through_store(group, topic: str, value, deadline: Deadline, what: str) -> List[bytes]:
    """Every rank's value (str or bytes) in group-rank order, swapped through
    the job's store under the group's unique name, so any job (gloo-only
    included) can rendezvous; a rank silent past the deadline raises PeerTimeout."""
    store = dist.distributed_c10d._get_default_store()
    prefix = f"pz/{topic}/{group.group_name}/"
    store.set(prefix + str(dist.get_rank(group)), value)
    keys = [prefix + str(j) for j in range(dist.get_world_size(group))]
    try:
        store.wait(keys, datetime.timedelta(seconds=deadline.left()))
        values = [store.get(k) for k in keys]
        # The store lives in global rank 0, which leaves only once every member
        # has read: a rank that raises on what it read (a mismatch) and exits
        # must not take the store down under a peer still reading.
        store.set(prefix + "read/" + str(dist.get_rank(group)), "1")
        if dist.get_rank() == 0:
            store.wait([prefix + "read/" + str(j) for j in range(dist.get_world_size(group))],
                       datetime.timedelta(seconds=deadline.left()))
    except Exception as e:  # noqa: BLE001 - the store's timeout error type varies by torch version
        raise PeerTimeout(f"a peer did not publish {what} within {deadline.timeout:g} s ({e})") from None
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
