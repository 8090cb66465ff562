"""Writes the golden weight-delta streams (format version 1) and their inputs:
<name>.base and <name>.target (raw little-endian bytes), <name>.pzd (the
stream), cases.json (each case's dtype). Run only on purpose (a format
version bump, or a case added at the end with every existing file unchanged):
    python tests/golden/delta/make_golden.py
tests/test_delta.py checks that the encoder reproduces every .pzd byte for
byte from its inputs and that apply rebuilds the target."""
import json
from pathlib import Path

import numpy as np
import torch

import portable_zip as pz

HERE = Path(__file__).resolve().parent
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _step(rng, base, frac, ulps):
    t = base.clone()
    k = int(frac * base.numel())
    idx = torch.from_numpy(rng.choice(base.numel(), k, replace=False))
    flat = t.view(INT[t.element_size()])
    flat[idx] = (flat[idx].to(torch.int64) + torch.from_numpy(rng.integers(-ulps, ulps + 1, k))).to(flat.dtype)
    return t


def cases():
    rng = np.random.default_rng(20261203)
    w = lambda n, dt: (torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) * 0.02).to(dt)  # noqa: E731
    b = w(20_000, torch.bfloat16)
    yield "bf16_1pct", b, _step(rng, b, 0.01, 3)
    b = w(5_000, torch.float32)
    yield "fp32_10pct", b, _step(rng, b, 0.1, 5)
    b = w(3_001, torch.float16)
    yield "fp16_all_changed", b, torch.from_numpy(rng.integers(0, 2**16, 3_001).astype(np.uint16)).view(torch.float16)
    b = w(777, torch.float8_e4m3fn)
    yield "fp8_e4m3fn_odd", b, _step(rng, b, 0.3, 2)
    b = w(1_234, torch.float8_e5m2)
    yield "fp8_e5m2_none", b, b.clone()
    yield "bf16_empty", torch.empty(0, dtype=torch.bfloat16), torch.empty(0, dtype=torch.bfloat16)


def main():
    meta = {}
    for name, base, target in cases():
        meta[name] = str(base.dtype).replace("torch.", "")
        (HERE / f"{name}.base").write_bytes(base.view(torch.uint8).numpy().tobytes())
        (HERE / f"{name}.target").write_bytes(target.view(torch.uint8).numpy().tobytes())
        (HERE / f"{name}.pzd").write_bytes(pz.delta.encode(base, target).numpy().tobytes())
    (HERE / "cases.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
