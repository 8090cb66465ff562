"""The C++ CPU codec against the independent numpy implementation of the format."""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import portable_zip as pz
from portable_zip import reference as ref
from portable_zip._dtypes import code_of
from conftest import CODED_DTYPES, fresh_rng, random_bits, same_bits, weights


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


CODECS = {"rans": 1, "fixed": 2}


def check_against_reference(t: torch.Tensor, codec: str = "rans") -> None:
    ours = pz.compress(t, codec=codec).numpy().tobytes()
    theirs = ref.compress(tensor_bytes(t), code_of(t.dtype), list(t.shape), CODECS[codec])
    assert ours == theirs, f"C++ and reference {codec} streams differ for {t.dtype}{list(t.shape)}"
    dtype, shape, data = ref.decompress(ours)
    assert dtype == code_of(t.dtype) and shape == tuple(t.shape) and data == tensor_bytes(t)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", [1, 33, 4097, 40_000])
def test_matches_reference(coded_dtype, numel, codec):
    rng = fresh_rng()
    check_against_reference(weights(rng, numel, coded_dtype), codec)
    check_against_reference(random_bits(rng, numel, coded_dtype), codec)


@pytest.mark.parametrize("codec", CODECS)
def test_matches_reference_multiblock_shapes(codec):
    rng = fresh_rng()
    check_against_reference(weights(rng, 3 * 4096 * 17 + 5, torch.float8_e5m2, 1.0), codec)
    check_against_reference(weights(rng, 300_000, torch.bfloat16).reshape(3, 100_000), codec)
    check_against_reference(torch.zeros(5, 0, 3, dtype=torch.float16), codec)
    check_against_reference(random_bits(rng, 999, torch.int32, (9, 111)), codec)


@given(numel=st.integers(1, 20_000), dtype=st.sampled_from(CODED_DTYPES), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-6, 0.02, 3.0]), codec=st.sampled_from(list(CODECS)))
def test_hypothesis_reference(numel, dtype, seed, scale, codec):
    check_against_reference(weights(np.random.default_rng(seed), numel, dtype, scale), codec)


def test_reference_decodes_roundtrip():
    t = weights(fresh_rng(), 10_001, torch.float32)
    _, _, data = ref.decompress(ref.compress(tensor_bytes(t), code_of(t.dtype), [10_001]))
    assert same_bits(torch.frombuffer(bytearray(data), dtype=torch.float32), t)
