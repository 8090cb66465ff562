"""The one point-to-point path and portable_zip.kv with GPU ranks over the
fabric (ci/gpu p2p-gpu): two ranks on one GPU, CUDA tensors every way."""
import numpy as np
import pytest
import torch

import p2p_workers
import portable_zip as pz
from portable_zip import _C
from harness.ranks import ok
from test_fabric import run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or pz.backend_info()["backend"] == "cpu"
                                 or bool(_C.fabric_probe()), reason="needs a GPU build with the fabric transport")]


@pytest.mark.parametrize("mode", ["always", "never", "auto"])
def test_gpu_point_to_point_and_kv(mode):
    seed = int(np.random.default_rng().integers(0, 2**31))
    res = ok(run(2, p2p_workers.gpu_path_and_kv, seed, mode, env={"PZ_TEST_DEVICES": "cuda,cuda",
                                                                   "PZ_PIECE_BYTES": str(1 << 20)}, deadline=300))
    assert res[0][0] == 5 and res[1][0] == 6, res
    if mode == "always":
        assert res[0][1]["send"].get("compressed", 0) >= 4, res
    if mode == "never":
        assert set(res[0][1]["send"]) == {"raw"}, res
