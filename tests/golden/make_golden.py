"""Regenerates the golden streams of the current format version, into
tests/golden/v<N>/ (the version-1 streams stay in tests/golden/ itself, never
rewritten: they check that old streams still decode). Run only on purpose,
with a format version bump (or, for a case added at the end, checking that
every existing file is unchanged):
    python tests/golden/make_golden.py
Cases with a plan (v4: 64 rANS lanes, which compress() picks only for
tensors of 2^27 symbols and more) are written by the reference encoder with
that plan, so small files hold every lane count the format allows."""
import json
from pathlib import Path

import numpy as np
import torch

import portable_zip as pz
from portable_zip.codec import reference as ref
from portable_zip.codec.dtypes import code_of

HERE = Path(__file__).resolve().parent


def cases():
    rng = np.random.default_rng(20261130)
    normal = lambda n, s: torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * s)  # noqa: E731
    yield "bf16_weights", normal(20_000, 0.02).to(torch.bfloat16).reshape(100, 200)
    yield "bf16_uniform", torch.from_numpy(rng.uniform(-1, 1, 9_001).astype(np.float32)).to(torch.bfloat16)
    yield "fp16_normal", normal(12_345, 1.0).to(torch.float16)
    yield "fp32_normal", normal(10_000, 1.0).reshape(10, 10, 100)
    yield "fp8_e4m3fn_odd", normal(7_777, 1.0).to(torch.float8_e4m3fn)
    yield "fp8_e5m2_odd", normal(9_999, 1.0).to(torch.float8_e5m2)
    yield "bf16_random_bits", torch.from_numpy(rng.integers(0, 2**16, 5_000, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    yield "int32_raw", torch.from_numpy(rng.integers(-1000, 1000, (33, 3), dtype=np.int32))
    yield "fp16_empty", torch.empty(0, 4, dtype=torch.float16)
    yield "bf16_scalar", torch.tensor(-2.5, dtype=torch.bfloat16)
    # Codec 2 (fixed-length code), added after the cases above so their draws are unchanged.
    yield "bf16_weights_fixed", normal(20_000, 0.02).to(torch.bfloat16), "fixed"
    yield "fp32_normal_fixed", normal(10_000, 1.0), "fixed"
    yield "fp8_e5m2_fixed", normal(9_999, 1.0).to(torch.float8_e5m2), "fixed"
    # Format v2: raw payloads of several checksum chunks (an odd tail), bools.
    yield "uint8_raw_chunks", torch.from_numpy(rng.integers(0, 256, 70_001, dtype=np.uint8))
    yield "bool_raw", torch.from_numpy(rng.integers(0, 2, 1_001).astype(np.bool_))
    # Format v4: 64 lanes (two states a GPU lane), partial last blocks and rows.
    yield "bf16_weights_wide", normal(20_000, 0.02).to(torch.bfloat16).reshape(40, 500), "rans", (12, 64)
    yield "fp16_normal_wide", normal(12_345, 1.0).to(torch.float16), "rans", (13, 64)
    yield "fp32_normal_wide", normal(3_000, 1.0), "rans", (10, 64)
    yield "fp8_e4m3fn_odd_wide", normal(7_777, 1.0).to(torch.float8_e4m3fn), "rans", (12, 64)
    yield "fp8_e5m2_odd_wide", normal(9_999, 1.0).to(torch.float8_e5m2), "rans", (10, 64)


def main():
    out = HERE / f"v{pz.backend_info()['format_version']}"
    out.mkdir(exist_ok=True)
    manifest = {}
    for name, t, *rest in cases():
        codec = rest[0] if rest else "rans"
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        (out / f"{name}.in").write_bytes(data)
        manifest[name] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "codec": codec}
        if len(rest) > 1:
            block_log2, lanes = rest[1]
            stream = ref.compress(data, code_of(t.dtype), list(t.shape), 1, block_log2, lanes)
            manifest[name]["plan"] = {"block_log2": block_log2, "lanes": lanes}
        else:
            stream = pz.compress(t, codec=codec).numpy().tobytes()
        (out / f"{name}.pz").write_bytes(stream)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
