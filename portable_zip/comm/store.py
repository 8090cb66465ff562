"""The job's store, bounded by a deadline: what construction swaps before
any transport exists. Any client of the store can write any key, so every
record carries a MAC keyed with the group's secret (group.py): a record
some other writer left (another run, a stale or garbled value) fails to
verify and raises MismatchError naming its key, on every rank."""
from __future__ import annotations

import hashlib
import hmac
import time
from typing import Callable, List, Optional

from .deadline import Deadline
from .errors import MismatchError, PeerError, PeerTimeout

_MAC = 16  # bytes of blake2b tag in front of each record


def seal(secret: bytes, topic: str, rank: int, value) -> bytes:
    """value (str or bytes) as rank's record of topic: its MAC, then value."""
    v = value.encode() if isinstance(value, str) else bytes(value)
    return _tag(secret, topic, rank, v) + v


def _tag(secret: bytes, topic: str, rank: int, v: bytes) -> bytes:
    h = hashlib.blake2b(key=secret, digest_size=_MAC)
    h.update(f"{topic}\0{rank}\0".encode())
    h.update(v)
    return h.digest()


_FAILED = "failed"  # a rank that gives up during construction says why here; the first one stays
POLL_S = 0.1      # how often, at most, a waiting rank looks for that


def give_up(group, why: str) -> None:
    """Tell every rank of group, waiting in construction, that this one failed
    (sealed: nothing outside the job can fake it). Best effort: the store may be gone."""
    rec = seal(group.secret, _FAILED, group.rank, f"{group.rank}|{why}")
    try:
        group.store.compare_set(_FAILED, "", rec)
    except Exception:  # noqa: BLE001 - a store without compare_set, or one already gone
        try:
            group.store.set(_FAILED, rec)
        except Exception:  # noqa: BLE001
            pass


def gave_up(group) -> Optional[PeerError]:
    """The PeerError for the rank that gave up, if one did."""
    try:
        if not group.store.check([_FAILED]):
            return None
        rec = group.store.get(_FAILED)
    except Exception:  # noqa: BLE001 - the store is gone: its host (global rank 0) left
        return PeerError("the job's store is unreachable: global rank 0, which holds it, has likely failed")
    for j in range(group.size):
        try:
            who, _, why = opened(group, _FAILED, j, rec, "its failure").decode().partition("|")
        except MismatchError:
            continue
        if int(who) == j:
            return PeerError(f"rank {j} (global {group.ranks[j]}) failed while the group was being built: {why}")
    return None


def wait_watching(group, keys: List[str], deadline: Deadline, what: str, watch: bool = True) -> None:
    """Wait until every key is in the store, raising at once if a rank gave
    up (give_up), else PeerTimeout naming the keys never written. Polls with
    check() (a timed-out store.wait() logs two warnings each time), backing
    off from 1 ms to POLL_S."""
    store, nap = group.store, 0.001
    while True:
        try:
            if store.check(keys):
                return
        except Exception as e:  # noqa: BLE001 - the store's error type varies by torch version
            raise PeerTimeout(f"the job's store failed while waiting for {what} (its host, global rank 0, has "
                              f"likely failed): {e}") from None
        err = gave_up(group) if watch else None
        if err is not None:
            if store.check(keys):  # it wrote its record, then gave up: this swap completed, and the
                return             # rank goes on to raise its own error, as it would have
            raise err
        if time.monotonic() >= deadline.at:
            late = [k for k in keys if not store.check([k])]
            raise PeerTimeout(f"a peer did not publish {what} within {deadline.timeout:g} s (missing: "
                              f"{', '.join(late)})")
        time.sleep(nap)
        nap = min(nap * 2, POLL_S)


def store_key(group, topic: str, rank: int) -> str:
    """The full key (the job's store) of rank's record of topic."""
    return f"pz/{group.name}/{topic}/{rank}"


def bad_record(group, topic: str, rank: int, what: str, why: str) -> MismatchError:
    """The error every rank raises for rank's record of topic (what: 'its device facts')."""
    what = what[4:] if what.startswith("its ") else what
    return MismatchError(f"store key '{store_key(group, topic, rank)}' (rank {rank}'s {what}) {why}")


def opened(group, topic: str, rank: int, record: bytes, what: str) -> bytes:
    """record's value once its MAC verifies, else MismatchError naming its key."""
    v = record[_MAC:]
    if len(record) < _MAC or not hmac.compare_digest(record[:_MAC], _tag(group.secret, topic, rank, v)):
        raise bad_record(group, topic, rank, what, f"does not verify: written by something other than this "
                         f"job's rank {rank}")
    return v


def swap_through_store(group, topic: str, value, deadline: Deadline, what: str,
                       parse: Optional[Callable[[bytes], object]] = None) -> List:
    """Every rank's value (str or bytes) in group-rank order, swapped through
    the job's store under the group's unique name (group: a Group), so any
    job (gloo-only included) can rendezvous; a rank silent past the deadline
    raises PeerTimeout. parse: applied to each verified value; a record
    that fails to verify or parse (ValueError, UnicodeError) raises
    MismatchError naming its key and writer, on every rank."""
    store = group.store
    prefix = f"{topic}/"
    store.set(prefix + str(group.rank), seal(group.secret, topic, group.rank, value))
    keys = [prefix + str(j) for j in range(group.size)]
    wait_watching(group, keys, deadline, what)
    try:
        records = [store.get(k) for k in keys]
        # The store lives in global rank 0, which leaves only once every member
        # has read: a rank that raises on what it read (a mismatch) and exits
        # must not take the store down under a peer still reading.
        store.set(prefix + "read/" + str(group.rank), "1")
    except Exception as e:  # noqa: BLE001 - the store's error type varies by torch version
        raise PeerError(f"the job's store failed while reading {what}: {e}") from None
    if group.ranks[group.rank] == 0:
        # Every record is in, so each rank reads and then raises its own error if
        # any: a rank that gave up after reading must not cut this wait short.
        wait_watching(group, [prefix + "read/" + str(j) for j in range(group.size)], deadline, what, watch=False)
    values = [opened(group, topic, j, r, what) for j, r in enumerate(records)]
    if parse is None:
        return values
    out = []
    for j, v in enumerate(values):
        try:
            out.append(parse(v))
        except (ValueError, UnicodeError) as e:
            raise bad_record(group, topic, j, what, f"does not parse ({e}): {bytes(v)[:80]!r}") from None
    return out
