import contextlib
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

CODED_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


WIDE_MIN = 1 << 27  # symbols from which the encoder plans 2^15-symbol blocks with 64 lanes (format v4)


@contextlib.contextmanager
def forced_plan(block_log2: int, lanes: int):
    """Every rANS compress of this process plans (block_log2, lanes): the
    64-lane coders on small tensors (_C.test_plan_override)."""
    from portable_zip import _C

    _C.test_plan_override(block_log2, lanes)
    try:
        yield
    finally:
        _C.test_plan_override(0, 32)


def fresh_rng() -> np.random.Generator:
    """A generator seeded from the OS: every run draws new inputs."""
    return np.random.default_rng()


def random_bits(rng: np.random.Generator, numel: int, dtype: torch.dtype, shape=None) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    if numel == 0:
        return torch.empty(shape if shape is not None else (0,), dtype=dtype)
    raw = rng.integers(0, 256, size=numel * size, dtype=np.uint8)
    t = torch.from_numpy(raw).view(dtype)
    return t.reshape(shape) if shape is not None else t


def weights(rng: np.random.Generator, numel: int, dtype: torch.dtype, scale: float = 0.02) -> torch.Tensor:
    return (torch.from_numpy(rng.standard_normal(numel, dtype=np.float32)) * scale).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True


def devices():
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


@pytest.fixture(params=CODED_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def coded_dtype(request):
    return request.param
