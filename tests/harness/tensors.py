"""The benchmark tensors, their ratio bars, and the order-0 entropy bound of
the codec's split: tests/test_ratio.py checks the bars, bench/codec.py reports them."""
from __future__ import annotations

import numpy as np
import torch

# name -> (dtype, distribution, ratio bar from the codec-core issue)
TENSORS = {
    "bf16 N(0,0.02^2)": (torch.bfloat16, "normal0.02", 0.670),
    "bf16 U[-1,1]": (torch.bfloat16, "uniform", 0.640),
    "fp16 N(0,1)": (torch.float16, "normal1", 0.86),
    "fp32 N(0,1)": (torch.float32, "normal1", 0.85),
    "fp8 e4m3fn U[-1,1]": (torch.float8_e4m3fn, "uniform", 0.79),
    "fp8 e5m2 U[-1,1]": (torch.float8_e5m2, "uniform", 0.70),
}
BAR = {name: bar for name, (_, _, bar) in TENSORS.items()}


def make_tensor(name: str, nbytes: int, rng: np.random.Generator, device: str = "cpu") -> torch.Tensor:
    dtype, dist, _ = TENSORS[name]
    n = nbytes // torch.empty(0, dtype=dtype).element_size()
    if dist == "uniform":
        v = rng.uniform(-1.0, 1.0, n).astype(np.float32)
    else:
        v = rng.standard_normal(n, dtype=np.float32) * (0.02 if dist == "normal0.02" else 1.0)
    return torch.from_numpy(v).to(dtype).to(device)


def symbols(t: torch.Tensor):
    """(symbol stream, raw bits per symbol) of the codec's split."""
    b = t.reshape(-1).view(torch.uint8).cpu().numpy()
    if t.dtype == torch.bfloat16:
        w = b.view("<u2")
        return (w >> 7) & 0xFF, 8
    if t.dtype == torch.float16:
        return b.view("<u2") >> 8, 8
    if t.dtype == torch.float32:
        return (b.view("<u4") >> 23) & 0xFF, 24
    x = np.zeros(b.size + (b.size & 1), np.uint8)
    x[: b.size] = b
    code = (x >> 3) & 0xF
    return code[0::2] | (code[1::2] << 4), 8


def exponent_entropy_bound(t: torch.Tensor) -> float:
    """Smallest ratio any order-0 coder of the symbol stream can reach (no headers)."""
    sym, raw_bits = symbols(t)
    p = np.bincount(sym.astype(np.int64), minlength=256) / sym.size
    p = p[p > 0]
    h = float(-(p * np.log2(p)).sum())
    return sym.size * (h + raw_bits) / (8 * t.numel() * t.element_size())
