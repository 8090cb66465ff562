"""The "pz" backend on GPUs: every op through dist.* on CUDA (HIP) tensors.
One GPU: two ranks share it, joined by the fabric (NCCL refuses two ranks
on one GPU), forwarded ops staged through host memory. Two GPUs: NCCL (RCCL)
inside."""
import numpy as np
import pytest
import torch

import backend_workers
from harness.ranks import run_ranks
from test_backend import ENV, ok

pytestmark = pytest.mark.gpu


def _check(res, seed):
    for r, (n, bad, digests) in res.items():
        assert not bad, f"seed {seed} rank {r}: {len(bad)} of {n} checks failed: {bad[:8]}"
        assert digests["never"] == digests["always"], f"seed {seed} rank {r}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_every_op_two_ranks_one_gpu_over_the_fabric():
    from portable_zip.comm.transports import fabric
    if fabric.unavailable():
        pytest.skip(f"the fabric transport is unavailable: {fabric.unavailable()}")
    seed = int(np.random.default_rng().integers(0, 2**31))
    res = ok(run_ranks(2, backend_workers.every_op, seed, 40_000, "cuda", "fabric", env=ENV, backend="gloo",
                       deadline=500, pg_timeout=120.0))
    _check(res, seed)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_every_op_nccl_inside():
    seed = int(np.random.default_rng().integers(0, 2**31))
    res = ok(run_ranks(2, backend_workers.every_op, seed, 40_000, "cuda", "auto", env=ENV, backend="nccl",
                       deadline=500, pg_timeout=120.0))
    _check(res, seed)
