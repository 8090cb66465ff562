"""Multi-process tests of pz.Communicator on gloo: every op, every dtype,
world sizes 2-4, async handles, and failures bounded in time."""
import numpy as np
import pytest

import comm_harness
import comm_workers
from harness.ranks import ok


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_op_every_dtype(world):
    rng = np.random.default_rng()
    seed = int(rng.integers(0, 2**31))  # fresh inputs and a fresh odd size every run
    sizes = [0, 1, 3, 4097, 20_001, int(rng.integers(5, 60_000)) | 1]
    passed = ok(comm_harness.run(world, comm_workers.battery, seed, sizes, deadline=600))
    # 4 moving ops x 2 modes for 5 dtypes, + 4 reduction ops x 2 kinds for 3 dtypes, per size;
    # + 2 integer-valued checks per reduction op and dtype (AVG only for world 2 and 4).
    expected = len(sizes) * (4 * 2 * 5 + 4 * 2 * 3) + 2 * 3 * (4 if world in (2, 4) else 3)
    assert all(n == expected for n in passed.values()), (seed, expected, passed)


@pytest.mark.parametrize("world", [2, 3])
def test_async_collectives(world):
    assert all(ok(comm_harness.run(world, comm_workers.async_ops, int(np.random.default_rng().integers(0, 2**31)))).values())


def test_auto_policy():
    backends = ok(comm_harness.run(2, comm_workers.auto_policy))
    assert "gloo" in backends[0]


def test_dead_peer_raises_within_timeout():
    res = comm_harness.run(3, comm_workers.dead_peer, 5.0, deadline=60)
    for r in (0, 1):
        assert res[r][0] == "ok", res[r]
        elapsed, kind, msg = res[r][1]
        assert elapsed < 15, (elapsed, msg)
        assert kind in ("PeerError", "PeerTimeout"), msg


def test_garbled_stream_from_peer_raises():
    res = ok(comm_harness.run(2, comm_workers.corrupt_peer, deadline=60))
    elapsed, msg = res[1]
    assert elapsed < 10 and "rank 0 sent an unreadable stream header" in msg and "version" in msg, msg
    assert res[0][0] < 15, res[0]


def test_silent_peer_times_out():
    res = comm_harness.run(2, comm_workers.hung_peer, 2.0, deadline=60)
    assert res[0][0] == "ok", res[0]
    elapsed, msg = res[0][1]
    assert 1.5 < elapsed < 10, elapsed
    assert "did not answer" in msg


@pytest.mark.parametrize("kind,pattern", [
    ("p2p_size", "mismatch.*bfloat16\\[100\\].*bfloat16\\[99\\]"),
    ("p2p_dtype", "mismatch.*bfloat16\\[100\\].*float16\\[100\\]"),
    ("collective_size", "numel 10[01]"),
    ("collective_dtype", "dtype"),
    ("version", "version mismatch"),
    ("p2p_version", "version mismatch"),
    ("p2p_count", "rank 0 sends 2 tensors but rank 1 expects 1"),
    ("mode", "compress= differs between ranks: rank 0 'always', rank 1 'never'"),
    ("fp8_reduce", "not defined for torch.float8_e4m3fn"),
])
def test_mismatch_raises_on_both_sides(kind, pattern):
    import re

    res = ok(comm_harness.run(2, comm_workers.mismatch, kind, deadline=60))
    for r in (0, 1):
        name, msg = res[r]
        assert name in ("MismatchError", "TypeError"), msg
        assert re.search(pattern, msg), (r, msg)


@pytest.mark.parametrize("world,wave_bytes", [(2, 1 << 23), (3, 30_000)])
def test_p2p_batches(world, wave_bytes):
    """Many tensors per peer in one isend/irecv group, in one wave or many."""
    seed = int(np.random.default_rng().integers(0, 2**31))
    assert all(ok(comm_harness.run(world, comm_workers.p2p_batch, seed, wave_bytes, deadline=300)).values()), seed


def test_pipelined_pieces(monkeypatch):
    """Compressed transfers cut into many pieces (the path large tensors take)."""
    monkeypatch.setenv("PZ_PIECE_BYTES", "4096")  # 8192-element pieces
    seed = int(np.random.default_rng().integers(0, 2**31))
    sizes = [20_001, 50_000]
    passed = ok(comm_harness.run(3, comm_workers.battery, seed, sizes, deadline=600))
    expected = len(sizes) * (4 * 2 * 5 + 4 * 2 * 3) + 2 * 3 * 3
    assert all(n == expected for n in passed.values()), (seed, expected, passed)


# --- issue 9 regressions: each failed before the plan-agreement redesign ---------------------

def _seed():
    return int(np.random.default_rng().integers(0, 2**31))


@pytest.mark.parametrize("world", [3, 4])
def test_batch_plan_is_per_pair(world):
    seed = _seed()
    ok(comm_harness.run(world, comm_workers.batch_plans, seed, deadline=300))


@pytest.mark.parametrize("world", [2, 3])
def test_learned_ratio_agrees(world):
    seed = _seed()
    ratios = ok(comm_harness.run(world, comm_workers.learned_ratio, seed, deadline=300))
    assert len(set(ratios.values())) == 1, ratios


def test_slower_than_predicted_is_rejudged_alike():
    seed = _seed()
    res = ok(comm_harness.run(2, comm_workers.rejudged, seed, deadline=300))
    plans, slowdowns = res[0]
    assert all(v == res[0] for v in res.values()), res  # the same plans and factor on every rank
    assert plans[:4] == ["compressed"] * 4 and plans[-1] == "native", plans
    assert len(set(slowdowns)) == 1 and slowdowns[0] > 1.5, slowdowns


@pytest.mark.parametrize("world", [2, 3])
def test_split_mismatch_raises_everywhere(world):
    res = ok(comm_harness.run(world, comm_workers.split_mismatch, deadline=120))
    for r, msg in res.items():
        assert msg and f"rank {world - 1} sends 3 rows to rank 0, which expects 2" in msg, (r, msg)


@pytest.mark.parametrize("world", [2, 3])
def test_in_place_all_to_all(world):
    ok(comm_harness.run(world, comm_workers.inplace_all_to_all, _seed(), deadline=300))


@pytest.mark.parametrize("what", ["reduce_scatter", "calibration"])
def test_silent_peer_bounded(what):
    res = comm_harness.run(2, comm_workers.silent_in, what, 3.0, deadline=90)
    assert res[0][0] == "ok", res[0]
    elapsed, msg = res[0][1]
    assert elapsed < 3.0 + 2.0, (elapsed, msg)


def test_argument_errors_are_local():
    res = ok(comm_harness.run(2, comm_workers.argument_errors, deadline=120))
    assert "wait(0.0)" in res[0] and "still running" in res[0]["wait(0.0)"], res[0]
    for r in (0, 1):
        assert not any("PeerError" in v for v in res[r].values()), res[r]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_plans_agree_under_check(world):
    seed = _seed()
    ok(comm_harness.run(world, comm_workers.agreement_battery, seed, 40, deadline=600))


@pytest.mark.parametrize("kind,world", [(k, w) for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                                         "dtype") for w in (2, 3)] + [("recv_larger", 2)])
def test_auto_mismatch_raises_under_check(kind, world):
    res = ok(comm_harness.run(world, comm_workers.auto_mismatch, kind, deadline=120))
    for r, (name, msg) in res.items():
        assert name == "MismatchError", (r, msg)


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_all_to_all_auto(world):
    plans = ok(comm_harness.run(world, comm_workers.uneven_all_to_all_auto, _seed(), deadline=300))
    assert len({str(p) for p in plans.values()}) == 1, plans


def test_async_op_beside_callers_own_collective():
    ok(comm_harness.run(2, comm_workers.async_then_direct, _seed(), deadline=120))


def test_divergent_calibration_cache_is_not_reused():
    ok(comm_harness.run(2, comm_workers.cache_divergence, _seed(), deadline=120))
