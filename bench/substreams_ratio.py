"""What several rANS sub-streams per block would cost in ratio (issue 12).

Format v3 gives each block 32 lane states: one sequential chain of n/32 steps
per lane. K independent states per lane (K sub-streams, interleaved step by
step) would give each lane K chains of n/(32K) steps: K-fold ILP, or the same
chain length from K-fold larger blocks. The price is K * 32 final states of 4
bytes per block. This measures it exactly: the v3 encoder of
portable_zip.codec.reference, with state k = step mod K, on real segment sizes
(table, word count, states, words, padding) against K = 1.

    python3 -P bench/substreams_ratio.py [--json bench/results/substreams-ratio.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from portable_zip.codec import reference as ref


def segment_bytes(sym: np.ndarray, k: int) -> int:
    """v3 segment size of one block with K states per lane (K = 1: format v3)."""
    n = sym.size
    freq = ref.quantize(np.bincount(sym, minlength=256), n)
    table = ref.table_bytes(freq)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint64)
    f_arr = np.array(freq, np.uint64)
    x = np.full((k, ref.LANES), ref.STATE_LOW, np.uint64)
    words = 0
    for step, row in enumerate(ref.lane_steps(n, 3)):
        lanes = row >= 0
        s = sym[row[lanes]]
        f, c = f_arr[s], cum[s]
        xs = x[step % k, lanes]
        need = xs >= (f << np.uint64(32 - ref.PROB_BITS))
        words += int(need.sum())
        xs[need] >>= np.uint64(16)
        x[step % k, lanes] = (xs // f << np.uint64(ref.PROB_BITS)) + xs % f + c
    prefix = ref.align(1 + len(table), 4) + 4 + 4 * ref.LANES * k
    return min(ref.align(prefix + 2 * words), ref.align(1 + n))


def bf16_symbols(numel: int, seed: int, dist: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.normal(0, 0.02, numel) if dist == "normal" else rng.uniform(-1, 1, numel)
    bits = (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncation: same exponent statistics
    return ((bits >> 7) & 0xFF).astype(np.uint8)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=24, help="blocks measured per case")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    for dist in ("normal", "uniform"):
        # The encoder's block sizes (2^12 below 4 MiB of bf16, 2^13 from 4 MiB, 2^14 from 32 MiB) and 2^15 (K = 2 there
        # keeps 2^14's chain length).
        for lg in (12, 13, 14, 15):
            n = 1 << lg
            sym = bf16_symbols(n * a.blocks, 1, dist)
            base = None
            for k in (1, 2, 4):
                t0 = time.time()
                seg = sum(segment_bytes(sym[b * n:(b + 1) * n], k) for b in range(a.blocks))
                # Per block also: 8 bytes of offset and 4 of checksum; raw planes are n bytes (bf16).
                ratio = (seg + a.blocks * (12 + n)) / (2 * n * a.blocks)
                base = ratio if k == 1 else base
                rows.append({"tensor": f"bf16 {'N(0,0.02^2)' if dist == 'normal' else 'U[-1,1]'}", "block_log2": lg,
                             "states_per_lane": k, "ratio": round(ratio, 5), "vs_v3": round(ratio - base, 5),
                             "steps_per_chain": n // (32 * k)})
                print(json.dumps(rows[-1]), f"{time.time() - t0:.1f}s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python3 -P bench/substreams_ratio.py", "date": time.strftime("%Y-%m-%d"),
                       "python": platform.python_version(), "numpy": np.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
