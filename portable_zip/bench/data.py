"""Benchmark tensors and the order-0 entropy bound of the codec's split."""
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


def _symbols(t: torch.Tensor):
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
    sym, raw_bits = _symbols(t)
    p = np.bincount(sym.astype(np.int64), minlength=256) / sym.size
    p = p[p > 0]
    h = float(-(p * np.log2(p)).sum())
    return sym.size * (h + raw_bits) / (8 * t.numel() * t.element_size())


def table_cost(t: torch.Tensor, block_log2: int) -> dict:
    """Ratio cost of block-local frequency tables against one global table.

    Both sides are estimated with the same model (ideal rANS cost of each
    symbol under the quantized 12-bit frequencies, plus per-block states, word
    count, mode byte and padding), so the difference is the tables' own cost
    and benefit: local tables pay ~40-70 B per block but fit each block's
    statistics; a global table is paid once but fits no block exactly.
    """
    from .. import reference as ref

    sym, raw_bits = _symbols(t)
    sym = sym.astype(np.int64)
    n = sym.size
    nbytes = t.numel() * t.element_size()
    bs = 1 << block_log2
    nblocks = -(-n // bs)
    raw_bytes = n * raw_bits // 8
    per_block = 1 + 3 + 4 + 4 * ref.LANES + 8 + 8  # mode, table padding (avg), W, states, offset, padding (avg)

    def coded_bits(counts, freq):
        f = np.asarray(freq, np.float64)
        used = counts > 0
        return float(-(counts[used] * np.log2(f[used] / ref.PROB_SCALE)).sum())

    counts = [np.bincount(sym[b * bs:(b + 1) * bs], minlength=256) for b in range(nblocks)]
    glob = np.sum(counts, axis=0)
    gfreq = ref.quantize(glob, n)
    local = glob_cost = 0.0
    for c in counts:
        lf = ref.quantize(c, int(c.sum()))
        local += coded_bits(c, lf) / 8 + len(ref.table_bytes(lf)) + per_block
        glob_cost += coded_bits(c, gfreq) / 8 + per_block
    glob_cost += len(ref.table_bytes(gfreq))
    return {"local_tables": (raw_bytes + local) / nbytes, "global_table": (raw_bytes + glob_cost) / nbytes}
