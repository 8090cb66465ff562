"""pz.weights between two GPUs over NCCL: the device paths of the engine
(delta encode/apply on the GPU, kept bases in pinned host memory, receive
buffers on the device), bit-exact over rounds, sharded, and repaired."""
import pytest
import torch

import comm_harness
import weights_workers as ww
from test_weights import SEED, deltas_after_first, ok

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)


def test_one_to_many_on_gpus():
    res = ok(comm_harness.run(2, ww.one_to_many, SEED, 3, 1500, deadline=300, backend="nccl"))
    assert res[0][0] == "real"
    deltas_after_first([sum(p["delta"] for p in r) for r in res[1][1]], "cpu")


def test_corrupted_delta_on_gpus():
    res = ok(comm_harness.run(2, ww.corrupt, SEED, deadline=300, backend="nccl"))
    assert [x[0] for x in res[1][1]] == [0, 2, 0]


def test_callback_receiver_on_gpus():
    res = ok(comm_harness.run(2, ww.callback, SEED, 3, "cpu", deadline=300, backend="nccl"))
    deltas_after_first([d for d, _ in res[1][1]], "cpu")
