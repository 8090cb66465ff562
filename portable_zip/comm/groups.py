"""The job's store, bounded by a deadline: what construction swaps before
any transport exists."""
from __future__ import annotations

import datetime
from typing import List

from .deadline import Deadline
from .errors import PeerTimeout


def swap_through_store(group, topic: str, value, deadline: Deadline, what: str) -> List[bytes]:
    """Every rank's value (str or bytes) in group-rank order, swapped through
    the job's store under the group's unique name (group: a Group), so any
    job (gloo-only included) can rendezvous; a rank silent past the deadline
    raises PeerTimeout."""
    store = group.store
    prefix = f"{topic}/"
    store.set(prefix + str(group.rank), value)
    keys = [prefix + str(j) for j in range(group.size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=deadline.left()))
        values = [store.get(k) for k in keys]
        # The store lives in global rank 0, which leaves only once every member
        # has read: a rank that raises on what it read (a mismatch) and exits
        # must not take the store down under a peer still reading.
        store.set(prefix + "read/" + str(group.rank), "1")
        if group.ranks[group.rank] == 0:
            store.wait([prefix + "read/" + str(j) for j in range(group.size)],
                       datetime.timedelta(seconds=deadline.left()))
    except Exception as e:  # noqa: BLE001 - the store's timeout error type varies by torch version
        raise PeerTimeout(f"a peer did not publish {what} within {deadline.timeout:g} s ({e})") from None
    return values
