"""The fabric transport with GPU ranks (ci/gpu's fabric stage): device memory
staged through the engine's pinned ring, GPU and CPU ranks in one job
(domains detected from the device kinds), over tcp;ofi_rxm on loopback.
Ranks may share one GPU: the fabric, unlike NCCL, does not mind."""
import numpy as np
import pytest
import torch

import fabric_workers
import portable_zip as pz
from portable_zip import _C
from harness.ranks import ok
from test_fabric import run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or pz.backend_info()["backend"] == "cpu" or bool(_C.fabric_probe()),
                                 reason="needs a GPU build with the fabric transport")]


def seed():
    return int(np.random.default_rng().integers(0, 2**31))


@pytest.mark.parametrize("devices", ["cuda,cuda", "cuda,cpu", "cpu,cuda,cuda", "cuda,cpu,cuda,cpu"])
def test_gpu_ranks_over_fabric(devices):
    world = devices.count(",") + 1
    sizes = [0, 1, 4097, int(np.random.default_rng().integers(5, 3_000_000)) | 1]
    res = ok(run(world, fabric_workers.fabric_battery, seed(), sizes, None, ("always", "never"),
                 env={"PZ_TEST_DEVICES": devices}, deadline=600))
    expected = 2 * (len(sizes) * (4 * 5 + 2 * 4 * 3) + 2)
    assert all(n == expected for n, _ in res.values()), (expected, res)


@pytest.mark.parametrize("devices", ["cuda,cpu,cpu", "cpu,cuda,cpu,cpu"])
def test_mixed_job_detects_domains(devices):
    """transport='auto' on a gloo job with GPU and CPU ranks: domains come
    from the device kinds; the CPU ranks' domain uses gloo inside."""
    world = devices.count(",") + 1
    res = ok(run(world, fabric_workers.fabric_battery, seed(), [0, 3, 200_003], None, ("always", "never", "auto"),
                 "auto", env={"PZ_TEST_DEVICES": devices}, deadline=600))
    assert all("domains" in backend for _, backend in res.values()), res


def test_staged_edges_on_gpu():
    env = {"PZ_TEST_DEVICES": "cuda,cuda,cpu", "PZ_FABRIC_CHUNK": str(64 << 10), "PZ_FABRIC_RAILS": "3",
           "PZ_FABRIC_DEPTH": "2"}
    res = ok(run(3, fabric_workers.staged_edges, seed(), env=env))
    assert all(n == 2 * 9 * 3 * 2 * 2 for n, _ in res.values()), res


def test_max_sms_caps_every_launch():
    """The SM budget reaches every codec launch a Communicator makes, on
    every thread: the codec's own report of the grids it launched says so."""
    res = ok(run(2, fabric_workers.sm_budget_everywhere, seed(), env={"PZ_TEST_DEVICES": "cuda,cuda"},
                 deadline=600))
    for rank, (reports, sms) in res.items():
        for name, cap in (("max_sms=2", 2), ("sm_budget(3)", 3)):
            rep = reports[name]
            assert rep["launches"] >= 6 and 1 <= rep["max_sms"] <= cap, (rank, name, rep)
        assert reports["none"]["max_sms"] == sms, (rank, reports["none"], sms)
