"""pz.weights over gloo at 2-4 ranks: one-to-many and sharded many-to-many
rounds bit-exact, deltas after the first round, version skew and a late
joiner synced in full with the reason, a corrupted delta repaired in the same
round, mismatched buffers raising MismatchError on every rank, and a killed
peer raising PeerError on the survivors within the timeout."""
import pytest

import comm_harness
import weights_workers as ww
from harness.ranks import ok

SEED = 1234


def deltas_after_first(deltas, keep_base):
    """No delta in round 0; deltas in every later round, or none without a kept base."""
    assert deltas[0] == 0 and (all(d > 0 for d in deltas[1:]) if keep_base else not any(deltas)), deltas


def impl(res):
    """Which delta codec the ranks ran: the real one wherever this build has it."""
    import portable_zip as pz

    kinds = {v[0] for v in res.values()}
    assert kinds == {"real" if hasattr(pz._C, "delta_checksum_cpu") else "fake"}, kinds
    return kinds.pop()


@pytest.mark.parametrize("world", [2, 3])
def test_one_to_many_rounds_bit_exact(world):
    res = ok(comm_harness.run(world, ww.one_to_many, SEED, 3, 1500, deadline=120))
    impl(res)
    for r in range(1, world):
        rounds = res[r][1]
        assert rounds == res[0][1]  # the same plan and stats on every rank
        first, later = rounds[0][0], rounds[1:]
        assert first["delta"] == 0 and first["buckets"] > 1
        assert {f["reason"] for f in first["fallbacks"]} >= {"first sync"}
        for (p,) in later:
            # delta for every coded dtype (bf16, fp16, fp32); int64 travels full, saying why
            assert p["delta"] > 0 and p["repaired"] == 0
            assert {f["reason"] for f in p["fallbacks"]} == {"no delta coding for torch.int64"}


def test_version_skew_and_late_joiner():
    res = ok(comm_harness.run(4, ww.skew, SEED, deadline=120))
    impl(res)
    r1, r2, r3 = res[1][1], res[2][1], res[3][1]
    assert sorted(r1) == [0, 1, 2, 3] and sorted(r2) == [0, 2, 3] and sorted(r3) == [2, 3]
    why = {(f["receiver"], f["name"]): f["reason"] for f in r1[2][0]["fallbacks"]}
    assert why[(2, "embed")].startswith("missed step: receiver holds version 0, sender's base is 1"), why
    assert why[(3, "embed")] == "receiver holds no version (late join or restart)", why
    assert (1, "embed") not in why  # rank 1 took a delta
    assert all(f["name"] == "ids" for f in r1[3][0]["fallbacks"])  # round 3: every receiver deltas again
    assert r1[2] == r2[2] == r3[2] and r1[3] == r3[3]


@pytest.mark.parametrize("part_bytes", [None, 3000])
def test_sharded_many_to_many(part_bytes):
    res = ok(comm_harness.run(4, ww.sharded, SEED, 3, part_bytes, deadline=120))
    impl(res)
    assert res[0][1] == res[1][1] == res[2][1] == res[3][1]
    rounds = res[0][1]
    if part_bytes:
        assert all(len(parts) > 1 for parts in rounds)  # streamed in parts
    assert sum(p["delta"] for p in rounds[0]) == 0
    for parts in rounds[1:]:
        assert sum(p["full"] for p in parts) == 0 and sum(p["delta"] for p in parts) > 0


@pytest.mark.parametrize("keep_base", [None, "cpu"])
def test_callback_receiver(keep_base):
    res = ok(comm_harness.run(2, ww.callback, SEED, 3, keep_base, deadline=120))
    impl(res)
    deltas_after_first([d for d, _ in res[1][1]], keep_base)
    assert all(calls > 1 for _, calls in res[1][1])  # loaded bucket by bucket


def test_corrupted_delta_is_repaired_in_the_same_round():
    res = ok(comm_harness.run(3, ww.corrupt, SEED, deadline=120))
    impl(res)
    for r in (1, 2):
        (rep0, _, _), (rep1, why1, d1), (rep2, _, d2) = res[r][1]
        assert rep0 == 0 and rep2 == 0 and d2 > 0
        assert rep1 == 2 and {w["name"] for w in why1} == {"layer.0.w"}, why1
        assert all(w["reason"].startswith(("FormatError", "BaseMismatch")) for w in why1), why1
    assert [x[0] for x in res[0][1]] == [2, 0]


@pytest.mark.parametrize("kind,pattern", [
    ("shape", r"'layer.0.w': rank 0 has torch.bfloat16\[40, 33\] but rank 2's receive buffer is torch.bfloat16\[40, 32\]"),
    ("dtype", r"'norm': rank 0 has torch.bfloat16\[24\] but rank 1's receive buffer is torch.float16\[24\]"),
    ("extra_name", r"rank 1 expects weights no sender sent: \['missing'\]"),
    ("unwanted_name", r"weights sent that no receiver takes: \['layer.1.w'\]"),
])
def test_mismatch_raises_on_every_rank(kind, pattern):
    import re

    res = ok(comm_harness.run(3, ww.mismatch, kind, deadline=90))
    for r in range(3):
        name, msg, _ = res[r]
        assert name == "MismatchError" and re.search(pattern, msg), (r, name, msg)


@pytest.mark.parametrize("victim", [0, 2])
def test_killed_peer_raises_within_timeout(victim):
    res = comm_harness.run(3, ww.killed, victim, 4.0, deadline=90)
    for r in range(3):
        if r == victim:
            continue
        assert res[r][0] == "ok", res[r]
        kind, elapsed, msg = res[r][1]
        assert kind in ("PeerError", "PeerTimeout") and elapsed < 12, (r, kind, elapsed, msg)


@pytest.mark.parametrize("keep_base", ["cpu", None])
def test_vllm_engine_through_the_stand_in(keep_base):
    """The vLLM adapter end to end against tests/fake_vllm.py (vLLM has no CPU wheel)."""
    res = ok(comm_harness.run(3, ww.vllm_e2e, SEED, 3, keep_base, deadline=120))
    impl(res)
    deltas_after_first(res[0][1], keep_base)
    for r in (1, 2):
        loads, reloads = res[r][1]
        assert len(loads) == 3 and all(n > 1 for n in loads)  # load_weights once per bucket, not once per round
        assert reloads == ["start", "finish"] * 3


@pytest.mark.parametrize("keep_base,rebuild_group", [("cpu", False), (None, False), ("cpu", True)])
def test_verl_engine_through_the_stand_in(keep_base, rebuild_group):
    """The verl adapter end to end against tests/fake_verl.py (verl's import needs ray, fastapi, torch pins);
    a group rebuilt every step keeps the kept base, so deltas continue."""
    res = ok(comm_harness.run(4, ww.verl_e2e, SEED, 3, keep_base, rebuild_group, deadline=120))
    impl(res)
    deltas_after_first(res[0][1], keep_base)
    assert res[1][1] == [-1.0] * 3  # the second actor rank drained and sent nothing
