"""torch dtype <-> format dtype code (include/portable_zip/format.h, DType)."""
from __future__ import annotations

import torch

_NAMES = {
    1: "bfloat16", 2: "float16", 3: "float32", 4: "float8_e4m3fn", 5: "float8_e5m2",
    6: "float64", 7: "uint8", 8: "int8", 9: "int16", 10: "int32", 11: "int64", 12: "bool",
    13: "complex64", 14: "complex128", 15: "float8_e4m3fnuz", 16: "float8_e5m2fnuz",
    17: "uint16", 18: "uint32", 19: "uint64", 20: "complex32", 21: "float8_e8m0fnu",
}
# Some builds of torch lack some dtypes; map only those that exist.
CODE_TO_DTYPE = {c: getattr(torch, n) for c, n in _NAMES.items() if hasattr(torch, n)}
DTYPE_TO_CODE = {d: c for c, d in CODE_TO_DTYPE.items()}
# The dtypes the codec compresses (the rest are stored raw), defined here only.
# Ordered: the policy packs per-dtype calibration figures in this order, so it
# must be the same on every rank (and stay so).
CODED = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
CODECS = {0: "raw", 1: "rans", 2: "fixed"}
CODEC_CODES = {"rans": 1, "fixed": 2}


def code_of(dtype: torch.dtype) -> int:
    try:
        return DTYPE_TO_CODE[dtype]
    except KeyError:
        raise TypeError(f"portable_zip cannot store dtype {dtype}") from None


def dtype_of(code: int) -> torch.dtype:
    try:
        return CODE_TO_DTYPE[code]
    except KeyError:
        raise TypeError(f"stream dtype code {code} has no torch dtype in this torch build") from None
