"""portable_zip.kv over gloo at 2-4 ranks: every dtype and both layouts bit
exact into different, non-contiguous block ids with sentinels untouched,
layer-by-layer waits, one prefill to three decodes with concurrent requests
under each compress mode, misuse raising, a corrupted payload or a forged
descriptor failing its request, and a killed decode rank failing the
prefill's request within seconds."""
import random

import pytest

import comm_harness
import kv_workers as kw
from harness.ranks import ok

ENV = {"PZ_CHECK_PLANS": "1"}


def seed():
    return random.SystemRandom().randrange(1 << 30)  # fresh data every run


@pytest.mark.parametrize("mode", ["never", "always"])
def test_roundtrip_every_dtype_and_layout(mode):
    res = ok(comm_harness.run(2, kw.roundtrip, seed(), mode, env=ENV, deadline=90))
    sent = res[0]["send"]["plans"]
    payloads = 8 * kw.LAYERS + kw.LAYERS  # 4 dtypes x 2 layouts, then the layered request
    # The Communicator's mode decided: under "always" every payload compressed (int64 descriptors travel raw).
    assert sent == ({"raw": 2 * payloads + 1} if mode == "never" else {"raw": payloads + 1, "compressed": payloads}), sent
    assert res[1]["recv"]["plans"] == sent


@pytest.mark.parametrize("mode", ["never", "always", "auto"])
def test_one_prefill_to_three_decodes(mode):
    res = ok(comm_harness.run(4, kw.fanout, seed(), mode, env=ENV, deadline=90))
    sent = res[0]["send"]["plans"]
    payloads = 6 * kw.LAYERS
    if mode == "never":
        assert set(sent) == {"raw"} and sent["raw"] >= 2 * payloads + 3, sent
    elif mode == "always":
        assert sent["compressed"] == payloads and sent["raw"] >= payloads + 3, sent
    else:
        assert sum(sent.values()) == res[0]["send"]["calls"], sent
    for r in (1, 2, 3):
        assert "send" not in res[r] and res[r]["recv"]["calls"] > 0


def test_misuse_corruption_and_forgery_fail_the_request():
    res = ok(comm_harness.run(2, kw.misuse, seed(), env=ENV, deadline=90))
    tx, rx = res[0], res[1]
    assert "'nope'" in tx["send_layer unknown"] and "'good'" in tx["start finished"], tx
    assert "already being sent" in tx["start duplicate"] and "'dup'" in tx["aborted wait"], tx
    assert "'good'" in rx["recv finished"] and "already being received" in rx["recv duplicate"], rx
    assert rx["corrupt"].startswith("KVIntegrityError") and "'corrupt'" in rx["corrupt"], rx
    assert rx["forged"].startswith("KVMismatchError") and "'forged'" in rx["forged"], rx
    assert "aborted" in rx["dup aborted"] and "'dup'" in rx["dup aborted"], rx


def test_killed_decode_fails_the_request_within_seconds():
    res = comm_harness.run(2, kw.killed, seed(), env=ENV, deadline=90)
    assert res[0][0] == "ok", res[0]
    name, is_peer, rid, text, took, close_took = res[0][1]
    assert is_peer and rid == "doomed" and "'doomed'" in text, res[0][1]
    assert took < 10 and close_took < 10, res[0][1]
