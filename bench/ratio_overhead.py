"""Where a bf16 stream's bytes go past the order-0 bound, per size: the
overhead of the rANS lanes' final states, the block offsets and checksums,
and the rest (frequency tables, mode byte, word count, padding, less what
block-local tables gain over one global table). The stream is the CPU
encoder's, which every backend writes byte for byte.

A final state takes 4 bytes but carries about 1 byte of coded data (it
starts at 2^16 and ends roughly log-uniform in [2^16, 2^32)), so its
overhead is counted as 3 bytes: substreams-ratio.json measured 2.95-2.98
bytes per extra state (2 states a lane at 2^12-2^14-symbol blocks).

Also the ratio two format changes would give, from the same counts:
- "carry16": each lane's initial state carries 16 bits of the block's raw
  plane (x0 = 2^16 + r instead of 2^16): 16 bits less in the raw plane,
  less the 0.56 bit a larger starting state costs, 1.93 bytes a lane;
- "chains2": twice the chains per block (twice the lanes, the block size
  kept), with and without carry16.
Both assume every block is rANS-coded (a stored block has no states).

    python -P bench/ratio_overhead.py [--sizes 1MiB,4MiB,16MiB,64MiB] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench import real_weights  # noqa: E402
from pzbench.common import bench_tensor, parse_size, print_table, write_json  # noqa: E402
from harness.tensors import exponent_entropy_bound  # noqa: E402

import portable_zip as pz  # noqa: E402

STATE_OVERHEAD = 3.0  # bytes of a 4-byte final state that carry no coded data (docstring)
CARRY_BYTES = 2 - 0.557 / 8  # 16 raw bits, less E[log2(1 + r / 2^16)] for r uniform in [0, 2^16)
PER_BLOCK_INDEX = 8 + 4  # u64 offset + u32 checksum


def row(name: str, nbytes: int, seed: int) -> dict:
    t = bench_tensor(name, nbytes, np.random.default_rng(seed))
    info = pz.inspect(pz.compress(t))
    n_blocks, lanes = info["blocks"], info["lanes"]
    bound = exponent_entropy_bound(t)
    states = n_blocks * lanes * STATE_OVERHEAD
    index = n_blocks * PER_BLOCK_INDEX
    rest = info["compressed_bytes"] - bound * nbytes - states - index
    saved = n_blocks * lanes * CARRY_BYTES
    return {
        "tensor": name, "bytes": nbytes, "blocks": n_blocks, "block_symbols": info["block_symbols"], "lanes": lanes,
        "ratio": info["ratio"], "bound": bound, "states": states / nbytes, "offsets_sums": index / nbytes,
        "rest": rest / nbytes, "carry16": info["ratio"] - saved / nbytes,
        "chains2": info["ratio"] + states / nbytes,  # as many states again
        "chains2_carry16": info["ratio"] + (states - 2 * saved) / nbytes,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1MiB,4MiB,16MiB,64MiB")
    p.add_argument("--tensors", default=None, help="default: bf16 N(0,0.02^2), bf16 U[-1,1] and the real sets prepared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    names = a.tensors.split(";") if a.tensors else ["bf16 N(0,0.02^2)", "bf16 U[-1,1]"] + (
        [] if real_weights.missing() else list(real_weights.REAL))
    rows = [row(n, parse_size(s), a.seed) for n in names for s in a.sizes.split(",")]
    print_table(rows, ["tensor", "bytes", "blocks", "lanes", "ratio", "bound", "states", "offsets_sums", "rest",
                       "carry16", "chains2", "chains2_carry16"],
                "bf16 ratio past the order-0 bound, as fractions of the input "
                "(CPU encoder's streams; states: their 3 B of overhead each)")
    if a.json:
        write_json(a.json, rows, {"method": __doc__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
