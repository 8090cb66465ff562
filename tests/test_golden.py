"""Committed golden streams: any change to the bytes must be a deliberate format change."""
import json
from pathlib import Path

import pytest
import torch

import portable_zip as pz
from portable_zip import reference as ref
from conftest import same_bits

GOLDEN = Path(__file__).resolve().parent / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())


def load(name):
    meta = MANIFEST[name]
    dtype = getattr(torch, meta["dtype"])
    raw = (GOLDEN / f"{name}.in").read_bytes()
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
    return t.reshape(meta["shape"]), (GOLDEN / f"{name}.pz").read_bytes()


def test_manifest_covers_every_coded_dtype():
    assert {m["dtype"] for m in MANIFEST.values()} >= {"bfloat16", "float16", "float32", "float8_e4m3fn",
                                                         "float8_e5m2", "int32"}


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_compress_reproduces_golden(name):
    t, golden = load(name)
    assert pz.compress(t, codec=MANIFEST[name]["codec"]).numpy().tobytes() == golden


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_golden_decodes(name):
    t, golden = load(name)
    buf = torch.frombuffer(bytearray(golden), dtype=torch.uint8)
    assert same_bits(pz.decompress(buf), t)
    _, shape, data = ref.decompress(golden)
    assert shape == tuple(t.shape)
    assert data == (t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
