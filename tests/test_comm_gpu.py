"""The communicator on NCCL between two GPUs (ci/gpu on nvidia-h200-x2)."""
import numpy as np
import pytest
import torch

import comm_harness
import comm_workers
from harness.ranks import ok

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)


def test_nccl_every_op_every_dtype():
    seed = int(np.random.default_rng().integers(0, 2**31))
    sizes = [0, 1, 3, 4097, 20_001, 3_000_001]
    passed = ok(comm_harness.run(2, comm_workers.battery, seed, sizes, deadline=900, backend="nccl"))
    expected = len(sizes) * (4 * 2 * 5 + 4 * 2 * 3) + 2 * 3 * 4
    assert all(n == expected for n in passed.values()), (seed, expected, passed)


def test_nccl_auto_policy():
    backends = ok(comm_harness.run(2, comm_workers.auto_policy, backend="nccl", deadline=300))
    assert "NCCL" in backends[0]


@pytest.mark.parametrize("kind", ["p2p_size", "collective_dtype", "version", "fp8_reduce"])
def test_nccl_mismatch(kind):
    res = ok(comm_harness.run(2, comm_workers.mismatch, kind, deadline=120, backend="nccl"))
    assert all(res[r][0] in ("MismatchError", "TypeError") for r in (0, 1)), res


def test_nccl_silent_peer_times_out():
    res = comm_harness.run(2, comm_workers.hung_peer, 3.0, deadline=120, backend="nccl")
    assert res[0][0] == "ok", res[0]
    assert res[0][1][0] < 15


def test_nccl_pipelined_pieces(monkeypatch):
    monkeypatch.setenv("PZ_PIECE_BYTES", str(1 << 20))
    seed = int(np.random.default_rng().integers(0, 2**31))
    sizes = [3_000_001]
    passed = ok(comm_harness.run(2, comm_workers.battery, seed, sizes, deadline=300, backend="nccl"))
    expected = len(sizes) * (4 * 2 * 5 + 4 * 2 * 3) + 2 * 3 * 4
    assert all(n == expected for n in passed.values()), (seed, expected, passed)


# Issue 9 on NCCL (2 GPUs: the 3-4 rank cases run on gloo in CI).
def test_nccl_learned_ratio_agrees():
    seed = int(np.random.default_rng().integers(0, 2**31))
    ratios = ok(comm_harness.run(2, comm_workers.learned_ratio, seed, deadline=300, backend="nccl"))
    assert len(set(ratios.values())) == 1, ratios


def test_nccl_split_mismatch_raises_everywhere():
    res = ok(comm_harness.run(2, comm_workers.split_mismatch, deadline=120, backend="nccl"))
    assert all(msg and "rank 1 sends 3 rows to rank 0, which expects 2" in msg for msg in res.values()), res


def test_nccl_in_place_all_to_all():
    ok(comm_harness.run(2, comm_workers.inplace_all_to_all, int(np.random.default_rng().integers(0, 2**31)),
                        deadline=300, backend="nccl"))


def test_nccl_plans_agree_under_check():
    seed = int(np.random.default_rng().integers(0, 2**31))
    ok(comm_harness.run(2, comm_workers.agreement_battery, seed, 60, deadline=600, backend="nccl"))
