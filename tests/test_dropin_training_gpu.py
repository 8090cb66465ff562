"""tests/test_dropin_training.py's programs on GPUs: DDP and FSDP2 over the
"pz" world with NCCL inside (2 GPUs: every sum is a + b, so bit-identical
to plain NCCL), and DDP with CUDA parameters over a pz group of two ranks
sharing ONE GPU, joined by the fabric (NCCL refuses two ranks on a GPU)."""
import pytest
import torch

from harness.training import Run, run_training
from test_dropin_training import DDP_OPS, ENV, FSDP_OPS, MP, check, _check_stats
from test_hooks_gpu import GPU_ENV

pytestmark = pytest.mark.gpu
ENV = {**ENV, **GPU_ENV}


def _need(gpus: int):
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPU(s)")


def _nccl_runs(wrapping: str, **kw):
    """The program on plain NCCL, then on "pz" never, always, auto."""
    return [Run(wrapping, backend="nccl", device="cuda", **kw)] + [
        Run(wrapping, backend="pz", compress=m, device="cuda", **kw) for m in ("never", "always", "auto")]


def test_gpu_ddp_over_pz():
    _need(2)
    runs = _nccl_runs("ddp", steps=20)
    check(run_training(2, runs, backend="nccl", env=ENV), 2, runs, DDP_OPS, exact=True)


def test_gpu_fsdp2_over_pz():
    _need(2)
    runs = _nccl_runs("fsdp", steps=20, **MP)
    check(run_training(2, runs, backend="nccl", env=ENV), 2, runs, FSDP_OPS, exact=True)


def test_gpu_ddp_two_ranks_one_gpu_over_the_fabric():
    """init_process_group("gloo"), then new_group(backend="pz",
    Options(transport="fabric")) as DDP's process_group, CUDA parameters on
    cuda:0 in both ranks: replicas identical, always == never."""
    _need(1)
    from portable_zip.comm.transports import fabric
    if fabric.unavailable():  # a reason it is not
        pytest.skip(f"the fabric transport is unavailable: {fabric.unavailable()}")
    runs = [Run("ddp", backend="pz", subgroup=True, transport="fabric", compress=m, device="cuda", steps=10)
            for m in ("never", "always")]
    runs.append(Run("ddp", device="cuda", steps=10))  # plain gloo moving the same CUDA gradients
    res = run_training(2, runs, backend="gloo", env=ENV)
    for i, run in enumerate(runs[:2]):
        fps = [res[r][i]["fingerprints"] for r in range(2)]
        assert len(fps[0]) == 10 and fps[0] == fps[1], f"{run}: ranks' parameters differ"
        _check_stats(run, res[0][i]["group_stats"], DDP_OPS)
    assert res[0][1]["fingerprints"] == res[0][0]["fingerprints"], "compress='always' differs from 'never'"
    # Two ranks: every gradient sum has two terms, so pz's bytes are gloo's.
    assert res[0][0]["fingerprints"] == res[0][2]["fingerprints"], "pz over the fabric differs from gloo"
