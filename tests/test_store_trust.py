"""Records swapped through the job's store carry a MAC keyed with the
group's secret: a record some other store client wrote (garbage, another
run's record, a tampered one) or one that does not parse raises
MismatchError naming the full store key and the rank it stands for, on
every rank at once, and the failed construction keeps no descriptors or
threads. Deterministic: the forging rank's own store.set writes the forged
record in place of its real one, which is what a stranger overwriting the
key between publish and read leaves."""
import os
import re
import time

import pytest

import comm_harness
import portable_zip as pz
from portable_zip.comm import domains, store as groups
from portable_zip.comm.errors import MismatchError
from portable_zip.comm.transports import fabric
from test_close_leaks import FABRIC, grown, held
from harness.ranks import ok

TIMEOUT = 20.0


class _Store:
    """A store whose set() of `mine` writes forge(the sealed record) instead."""

    def __init__(self, store, mine: str, forge):
        self._store, self._mine, self._forge = store, mine, forge

    def set(self, key, value):
        self._store.set(key, self._forge(value) if key == self._mine else value)

    def __getattr__(self, name):
        return getattr(self._store, name)


class _Forging:
    """group as swap_through_store sees it, but this rank publishes a forged record."""

    def __init__(self, group, topic: str, forge):
        self._group = group
        self.store = _Store(group.store, f"{topic}/{group.rank}", lambda v: forge(group, topic, v))

    def __getattr__(self, name):
        return getattr(self._group, name)


FORGERIES = {
    # a stranger's bytes, no MAC at all
    "garbage": lambda g, topic, v: b"cpu|host",
    # a well-formed record sealed under another run's secret
    "foreign": lambda g, topic, v: groups.seal(os.urandom(16), topic, g.rank, v[16:]),
    # this run's record with one byte changed after sealing
    "tampered": lambda g, topic, v: v[:-1] + bytes([v[-1] ^ 1]),
    # sealed with this run's secret, but not a record of the topic
    "unparsable": lambda g, topic, v: groups.seal(g.secret, topic, g.rank, b"cpu|host|only three"),
}


def forged(rank, world, cases, transport):
    """Every rank constructs once per case (topic, how, forger): rank
    forger publishes its `topic` record forged `how`. Returns per case
    (error type, message, seconds, what the failed construction left)."""
    os.environ["PZ_FABRIC_PROVIDER"] = "tcp;ofi_rxm"
    pz.Communicator(compress="never", transport=transport, timeout=TIMEOUT).close()  # warm-up: one-time state
    out = []
    for topic, how, forger in cases:
        module = domains if topic == "facts" else fabric
        real = module.swap_through_store
        if rank == forger:
            module.swap_through_store = lambda group, t, *a, **k: real(_Forging(group, t, FORGERIES[how]), t, *a, **k)
        before, t0 = held(), time.monotonic()
        try:
            pz.Communicator(compress="never", transport=transport, timeout=TIMEOUT).close()
            out.append(("constructed", "", 0.0, ""))
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            out.append((type(e).__name__, str(e), time.monotonic() - t0, grown(before)))
        module.swap_through_store = real
    return out


def _check(res, cases, what):
    for (topic, how, forger), i in zip(cases, range(len(cases))):
        why = "does not parse" if how == "unparsable" else \
            f"does not verify: written by something other than this job's rank {forger}"
        pattern = rf"store key 'pz/[^']+/{topic}/{forger}' \(rank {forger}'s {what}\) {re.escape(why)}"
        for r, got in res.items():
            kind, msg, took, left = got[i]
            assert kind == "MismatchError", (how, r, kind, msg)
            assert re.search(pattern, msg), (how, r, msg)
            assert took < TIMEOUT / 2, (how, r, took)  # at once, not at the deadline
            assert left == "", (how, r, left)


def test_forged_facts_raise_naming_the_key_on_every_rank():
    cases = [("facts", "garbage", 1), ("facts", "foreign", 0), ("facts", "tampered", 1), ("facts", "unparsable", 0)]
    _check(ok(comm_harness.run(2, forged, cases, "torch", deadline=90)), cases, "device facts")


@pytest.mark.skipif(not FABRIC, reason="no fabric transport here")
def test_forged_fabric_address_raises_naming_the_key_on_every_rank():
    cases = [("fabric", "garbage", 1), ("fabric", "foreign", 0)]
    _check(ok(comm_harness.run(2, forged, cases, "fabric", deadline=90)), cases, "fabric address")


class _Group:
    name, rank, secret = "g.0123", 0, bytes(range(16))


def test_sealed_records_open_only_unchanged():
    g = _Group()
    rec = groups.seal(g.secret, "facts", 1, "cpu|h|cpu:3|None")
    assert groups.opened(g, "facts", 1, rec, "its device facts") == b"cpu|h|cpu:3|None"
    # cut; shorter than a MAC; empty; another rank's record; another topic's
    for bad in [rec[:-1], rec[:8], b"", groups.seal(g.secret, "facts", 0, "cpu|h|cpu:3|None"),
                groups.seal(g.secret, "fabric", 1, "cpu|h|cpu:3|None")]:
        with pytest.raises(MismatchError, match=r"store key 'pz/g\.0123/facts/1' \(rank 1's device facts\) does "
                                                r"not verify"):
            groups.opened(g, "facts", 1, bad, "its device facts")


@pytest.mark.parametrize("record", [b"cpu|h|cpu:3", b"gpu|h|cpu:3|None", b"cpu|h|cpu|None", b"\xff|h|c:1|N"])
def test_facts_that_do_not_parse_raise_value_error(record):
    with pytest.raises(ValueError):
        domains.parse_facts(record)
    assert domains.parse_facts(b"cpu|h|cpu:3|None")["kind"] == "cpu"
