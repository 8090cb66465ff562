"""The C++ CPU codec against the independent numpy implementation of the format."""
import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import portable_zip as pz
from portable_zip.codec import reference as ref
from portable_zip.codec.dtypes import code_of
from conftest import CODED_DTYPES, forced_plan, fresh_rng, random_bits, same_bits, weights


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


CODECS = {"rans": 1, "fixed": 2}


def check_against_reference(t: torch.Tensor, codec: str = "rans", plan=None) -> None:
    """plan: (block_log2, lanes) forced on both encoders."""
    with forced_plan(*plan) if plan else contextlib.nullcontext():
        ours = pz.compress(t, codec=codec).numpy().tobytes()
    theirs = ref.compress(tensor_bytes(t), code_of(t.dtype), list(t.shape), CODECS[codec], *(plan or ()))
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


@pytest.mark.parametrize("plan", [(15, 64), (12, 64), (10, 64)])
def test_matches_reference_wide(coded_dtype, plan):
    """From 2^27 symbols the encoder codes 2^15-symbol blocks with 64 lanes
    (format v4), here forced on small tensors: the reference, written from
    docs/FORMAT.md, writes the same bytes (partial last blocks and rows,
    stored blocks) and decodes them."""
    rng = fresh_rng()
    check_against_reference(weights(rng, (1 << 16) + 777, coded_dtype), plan=plan)
    check_against_reference(random_bits(rng, 40_000, coded_dtype), plan=plan)


@pytest.mark.parametrize("dtype", CODED_DTYPES)
def test_reference_wide_plan_small(dtype):
    """64 lanes on small tensors (the reference encoder's plan override; the
    C++ encoder picks 64 lanes for big tensors only): the C++ decoder reads
    them, whatever the block size, partial rows included."""
    t = weights(fresh_rng(), 9_999, dtype, 1.0)
    for block_log2 in (10, 12, 16):
        stream = ref.compress(tensor_bytes(t), code_of(dtype), [9_999], 1, block_log2, 64)
        buf = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
        assert pz.inspect(buf)["lanes"] == 64
        assert same_bits(pz.decompress(buf), t)


@given(numel=st.integers(1, 20_000), dtype=st.sampled_from(CODED_DTYPES), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-6, 0.02, 3.0]), codec=st.sampled_from(list(CODECS)))
def test_hypothesis_reference(numel, dtype, seed, scale, codec):
    check_against_reference(weights(np.random.default_rng(seed), numel, dtype, scale), codec)


def test_reference_decodes_roundtrip():
    t = weights(fresh_rng(), 10_001, torch.float32)
    _, _, data = ref.decompress(ref.compress(tensor_bytes(t), code_of(t.dtype), [10_001]))
    assert same_bits(torch.frombuffer(bytearray(data), dtype=torch.float32), t)
