"""The communicator on NCCL with one GPU (ci/gpu on nvidia-h200): a 1-rank
group exercises the private NCCL group, the handshake and every op's native
and coded paths on device tensors; the 2-GPU suite is tests/test_comm_gpu.py."""
import numpy as np
import pytest
import torch

import comm_harness
import comm_workers
from harness.ranks import ok

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)


@pytest.mark.parametrize("check", ["0", "1"])
def test_nccl_one_rank_every_op(monkeypatch, check):
    monkeypatch.setenv("PZ_CHECK_PLANS", check)
    seed = int(np.random.default_rng().integers(0, 2**31))
    ok(comm_harness.run(1, comm_workers.one_rank, seed, deadline=300, backend="nccl"))
