"""pz.weights with GPU ranks: the device paths of the engine (delta
encode/apply on the GPU, kept bases in pinned host memory, receive buffers on
the device), bit-exact over rounds, sharded, and repaired. Two GPUs run it
over NCCL; one GPU runs it with every rank on that GPU over the fabric."""
import pytest
import torch

import comm_harness
import weights_workers as ww
import portable_zip as pz
from portable_zip import _C
from test_weights import SEED, deltas_after_first, impl, ok

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or pz.backend_info()["backend"] == "cpu":
    pytest.skip("needs a GPU build and a GPU", allow_module_level=True)

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
FABRIC = {"PZ_FABRIC_PROVIDER": "tcp;ofi_rxm", "PZ_TEST_WEIGHTS_FABRIC": "1", "PZ_TEST_WEIGHTS_DEVICE": "cuda:0"}
LINKS = [pytest.param({"backend": "nccl"}, id="nccl", marks=TWO_GPUS),
         pytest.param({"env": FABRIC}, id="one-gpu-fabric",
                      marks=pytest.mark.skipif(not _C.has_fabric or bool(_C.fabric_probe()), reason="no fabric"))]


@pytest.mark.parametrize("link", LINKS)
def test_one_to_many_on_gpus(link):
    world = 2 if "backend" in link else 3
    res = ok(comm_harness.run(world, ww.one_to_many, SEED, 3, 1500, deadline=300, **link))
    assert res[0][0] == "real"
    for rank in range(1, world):
        deltas_after_first([sum(p["delta"] for p in r) for r in res[rank][1]], "cpu")


@pytest.mark.parametrize("link", LINKS)
def test_corrupted_delta_on_gpus(link):
    world = 2 if "backend" in link else 3
    res = ok(comm_harness.run(world, ww.corrupt, SEED, deadline=300, **link))
    impl(res)
    for rank in range(1, world):  # each round's stats count the chunks repaired over every receiver
        (rep0, _, _), (rep1, why1, _), (rep2, _, d2) = res[rank][1]
        assert rep0 == 0 and rep1 == world - 1 and rep2 == 0 and d2 > 0
        assert {w["name"] for w in why1} == {"layer.0.w"}, why1
        assert all(w["reason"].startswith(("FormatError", "BaseMismatch")) for w in why1), why1
    assert [x[0] for x in res[0][1]] == [world - 1, 0]


@pytest.mark.parametrize("link", LINKS)
def test_callback_receiver_on_gpus(link):
    res = ok(comm_harness.run(2, ww.callback, SEED, 3, "cpu", deadline=300, **link))
    deltas_after_first([d for d, _ in res[1][1]], "cpu")


@pytest.mark.parametrize("link", LINKS[1:])
def test_sharded_on_one_gpu(link):
    res = ok(comm_harness.run(4, ww.sharded, SEED, 3, 900, deadline=300, **link))
    assert res[0] == res[1] == res[2] == res[3] and res[0][0] == "real"
    rounds = res[0][1]
    assert sum(p["delta"] for p in rounds[0]) == 0
    for parts in rounds[1:]:
        assert sum(p["full"] for p in parts) == 0 and sum(p["delta"] for p in parts) > 0
