"""pz.fsdp hooks and pz.ddp_comm_hook on GPUs over NCCL: the training runs
of tests/test_hooks.py (2 ranks, one GPU each: every sum is a + b, so each
hook run is bit-identical to the run without hooks) and the hooks beside
NCCL's own reduce-scatter (PREMUL_SUM, AVG, SUM in bf16, fp16, fp32)."""
import numpy as np
import pytest
import torch

import hook_workers
from harness.ranks import run_ranks
from harness.training import Run, run_training
from test_hooks import ENV, MP, _check_modes

pytestmark = pytest.mark.gpu
GPU_ENV = {**ENV, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _need(gpus: int):
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs (NCCL cannot put two ranks on one GPU)")


def test_gpu_ddp_hook_bit_identical_to_ddp():
    _need(2)
    runs = [Run("ddp", device="cuda"), Run("ddp_hook", compress="never", device="cuda"),
            Run("ddp_hook", compress="always", device="cuda"), Run("ddp_hook", compress="auto", device="cuda")]
    _check_modes(run_training(2, runs, backend="nccl", env=GPU_ENV), 2, runs, plain=0, exact=True)


def test_gpu_fsdp_hooks_bit_identical_to_fsdp():
    _need(2)
    runs = [Run("fsdp", device="cuda", **MP), Run("fsdp_hook", compress="never", device="cuda", **MP),
            Run("fsdp_hook", compress="always", device="cuda", **MP),
            Run("fsdp_hook", compress="auto", device="cuda", **MP)]
    _check_modes(run_training(2, runs, backend="nccl", env=GPU_ENV), 2, runs, plain=0, exact=True)


def test_gpu_fsdp_hooks_gradient_divide_factor():
    """FSDP2 passes NCCL PREMUL_SUM(1/3) here; the run without hooks uses NCCL's."""
    _need(2)
    runs = [Run("fsdp", divide_factor=3.0, device="cuda", **MP),
            Run("fsdp_hook", compress="never", divide_factor=3.0, device="cuda", **MP),
            Run("fsdp_hook", compress="always", divide_factor=3.0, device="cuda", **MP)]
    _check_modes(run_training(2, runs, backend="nccl", env=GPU_ENV), 2, runs, plain=0, exact=True)


def test_gpu_hsdp_hooks_2x2_mesh():
    _need(4)
    runs = [Run("hsdp", device="cuda", **MP), Run("hsdp_hook", compress="never", device="cuda", **MP),
            Run("hsdp_hook", compress="always", device="cuda", **MP)]
    _check_modes(run_training(4, runs, backend="nccl", env=GPU_ENV), 4, runs, plain=0, exact=True)


def test_gpu_hooks_called_directly():
    _need(2)
    seed = int(np.random.default_rng().integers(0, 2**31))
    res = run_ranks(2, hook_workers.gpu_checks, seed, backend="nccl", env=GPU_ENV, deadline=300)
    for r, (status, out) in res.items():
        assert status == "ok", (r, status, out)
        assert len(out["premul"]) == 27 and all(same and kept for *_, same, kept in out["premul"]), out["premul"]
        assert out["mixed"]["blocking"] and out["mixed"]["async"], out["mixed"]
        assert out["async"]
