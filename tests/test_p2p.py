"""The one point-to-point path (portable_zip/comm/p2p.py): tags, mismatches
in every mode, pieces, corruption, ACKs at exit, pairs kept apart."""
import numpy as np
import pytest

import comm_harness
import p2p_workers
from harness.ranks import ok


def seed():
    return int(np.random.default_rng().integers(0, 2**31))


@pytest.mark.parametrize("mode", ["never", "always"])
def test_tags_match_per_tag_in_posting_order(mode):
    res = ok(comm_harness.run(2, p2p_workers.tags_match_per_tag, seed(), mode, deadline=120))
    assert res[0] == "sent"
    assert res[1] == ({"raw": 4} if mode == "never" else {"compressed": 4}), res


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_receive_of_announced_size(mode):
    res = ok(comm_harness.run(2, p2p_workers.announced_size, seed(), mode, deadline=120,
                              env={"PZ_PIECE_BYTES": "131072"}))
    for r in (0, 1):
        assert "mismatch" in res[r] or "more than" in res[r], (r, res[r])
    assert "bfloat16[1000]" in res[1] and "1999 bytes" in res[1], res[1]


@pytest.mark.parametrize("via", ["communicator", "backend"])
@pytest.mark.parametrize("mode,case", [("never", "size"), ("never", "dtype"), ("auto", "size"), ("always", "dtype")])
def test_mismatch_raises_on_both_ranks_in_every_mode(via, mode, case):
    res = ok(comm_harness.run(2, p2p_workers.mismatch_in_mode, mode, case, via, deadline=120))
    theirs = "bfloat16[200001]" if case == "size" else "float16[200000]"
    for r in (0, 1):
        assert "mismatch" in res[r] and "bfloat16[200000]" in res[r] and theirs in res[r], (r, res[r])


def test_pieces_land_and_a_corrupt_piece_fails_only_its_message():
    res = ok(comm_harness.run(2, p2p_workers.pieces_and_corruption, seed(), deadline=120,
                              env={"PZ_PIECE_BYTES": "131072"}))
    assert len(res[0]) == 1 and "could not decode" in res[0][0], res[0]
    assert res[1][0] is True and res[1][2] is True, res[1]
    assert "corrupt stream" in res[1][1], res[1]
    assert res[1][3] == 2, res[1]  # two receives landed; the refused one is not counted


def test_send_completes_when_the_receiver_exits_right_after_its_recv():
    res = comm_harness.run(2, p2p_workers.receiver_exits_at_once, seed(), deadline=60)
    assert res[0][0] == "ok" and res[0][1] < 10, res


def test_a_mismatched_pair_leaves_a_third_rank_alone():
    res = ok(comm_harness.run(3, p2p_workers.third_rank_unaffected, seed(), deadline=120))
    assert res[0] == ["mismatch", True] and res[1] == ["mismatch", True] and res[2] == ["sent"], res


def test_compressed_sends_slower_than_predicted_turn_raw_and_are_retried():
    res = ok(comm_harness.run(2, p2p_workers.coded_seen, seed(), deadline=180))
    from portable_zip.comm.observed import CodedSeen
    plans, factor = res[0]
    run = CodedSeen.RUN
    assert res[1] == "received", res
    assert plans[:run] == ["compressed"] * run and plans[run] == "raw", plans
    retried = [i for i, p in enumerate(plans) if p == "compressed" and i > run]
    assert retried and retried[0] > run + 10 and factor > 1.0, (retried, factor)


def test_a_link_slower_than_calibrated_turns_sends_compressed():
    res = ok(comm_harness.run(2, p2p_workers.link_seen, seed(), deadline=180))
    from portable_zip.comm.observed import LinkSeen
    plans, factor = res[0]
    run = LinkSeen.RUN
    assert res[1] == "received", res
    assert plans[:run] == ["raw"] * run and plans[run] == "compressed", plans
    assert plans[run:].count("compressed") >= 6 and factor > 2, (plans, factor)
