"""The communicator on NCCL between two GPUs (ci/gpu on nvidia-h200-x2)."""
import numpy as np
import pytest
import torch

import comm_harness
import comm_workers
from test_comm import ok

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
