"""Committed golden streams: any change to the bytes must be a deliberate format change.

tests/golden/*.pz are format version 1 streams (written before the checksums
existed), tests/golden/v2/ version 2 streams (strided rANS lanes, a checksum
unit per symbol) and tests/golden/v3/ version 3 streams (32 lanes only): all
must keep decoding. tests/golden/v<N>/ holds the current version's streams,
which compress must reproduce byte for byte; those with a plan in the
manifest (64 lanes on a small tensor, which compress never picks) the
reference encoder must reproduce, and every decoder decode."""
import json
from pathlib import Path

import pytest
import torch

import portable_zip as pz
from portable_zip.codec import reference as ref
from conftest import same_bits
from portable_zip.codec.dtypes import code_of

GOLDEN = Path(__file__).resolve().parent / "golden"
CURRENT = pz.backend_info()["format_version"]
DIRS = {1: GOLDEN, 2: GOLDEN / "v2", 3: GOLDEN / "v3", CURRENT: GOLDEN / f"v{CURRENT}"}
MANIFESTS = {v: json.loads((d / "manifest.json").read_text()) for v, d in DIRS.items()}
CASES = [(v, name) for v in sorted(MANIFESTS) for name in sorted(MANIFESTS[v])]


def load(version, name):
    meta = MANIFESTS[version][name]
    dtype = getattr(torch, meta["dtype"])
    raw = (DIRS[version] / f"{name}.in").read_bytes()
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
    return t.reshape(meta["shape"]), (DIRS[version] / f"{name}.pz").read_bytes()


def test_manifests_cover_every_coded_dtype():
    assert CURRENT == 4
    for m in MANIFESTS.values():
        assert {x["dtype"] for x in m.values()} >= {"bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2",
                                                    "int32"}
    assert {"bool", "uint8"} <= {x["dtype"] for x in MANIFESTS[CURRENT].values()}


@pytest.mark.parametrize("name", sorted(MANIFESTS[CURRENT]))
def test_compress_reproduces_golden(name):
    t, golden = load(CURRENT, name)
    meta = MANIFESTS[CURRENT][name]
    if "plan" in meta:
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert ref.compress(data, code_of(t.dtype), list(t.shape), 1, meta["plan"]["block_log2"],
                            meta["plan"]["lanes"]) == golden
        assert pz.inspect(torch.frombuffer(bytearray(golden), dtype=torch.uint8))["lanes"] == meta["plan"]["lanes"]
    else:
        assert pz.compress(t, codec=meta["codec"]).numpy().tobytes() == golden


def test_wide_goldens_cover_every_coded_dtype():
    wide = {m["dtype"] for m in MANIFESTS[CURRENT].values() if m.get("plan", {}).get("lanes") == 64}
    assert wide == {"bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"}


@pytest.mark.parametrize("name", sorted(MANIFESTS[3]))
def test_v3_and_v4_differ_in_the_header_only(name):
    """v4 added the 64-lane plan: a 32-lane v4 stream is its v3 stream but for
    the version byte and the header checksum."""
    t3, v3 = load(3, name)
    t4, v4 = load(CURRENT, name)
    assert same_bits(t3, t4) and len(v3) == len(v4)
    diff = [i for i in range(len(v3)) if v3[i] != v4[i]]
    assert diff[0] == 4 and all(28 <= i < 32 for i in diff[1:]), diff


@pytest.mark.parametrize("version,name", CASES)
def test_golden_decodes(version, name):
    t, golden = load(version, name)
    buf = torch.frombuffer(bytearray(golden), dtype=torch.uint8)
    assert pz.inspect(buf)["format_version"] == version
    assert same_bits(pz.decompress(buf), t)
    _, shape, data = ref.decompress(golden)
    assert shape == tuple(t.shape)
    assert data == (t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


@pytest.mark.parametrize("name", sorted(MANIFESTS[1]))
def test_v1_and_v2_hold_the_same_symbols(name):
    """v2 added checksums only: the v1 golden's raw planes and block segments
    reappear unchanged in the v2 golden of the same tensor."""
    t1, v1 = load(1, name)
    t2, v2 = load(2, name)
    assert same_bits(t1, t2)
    i1 = pz.inspect(torch.frombuffer(bytearray(v1), dtype=torch.uint8))
    i2 = pz.inspect(torch.frombuffer(bytearray(v2), dtype=torch.uint8))
    assert i1["raw_bytes"] == i2["raw_bytes"] and i1["coded_bytes"] == i2["coded_bytes"]
    begin = i1["header_bytes"] + (-i1["header_bytes"] % 16)
    raw = slice(begin, begin + i1["raw_bytes"])
    assert v1[raw] == v2[raw]
    if i1["coded_bytes"]:
        assert v1[-i1["coded_bytes"]:] == v2[-i2["coded_bytes"]:]


@pytest.mark.parametrize("name", sorted(MANIFESTS[2]))
def test_v2_and_v3_share_raw_planes_and_sizes(name):
    """v3 moves symbols between rANS lanes and hashes words: the raw planes
    are unchanged, and so are the fixed code's segments."""
    t2, v2 = load(2, name)
    t3, v3 = load(3, name)
    assert same_bits(t2, t3)
    i2 = pz.inspect(torch.frombuffer(bytearray(v2), dtype=torch.uint8))
    i3 = pz.inspect(torch.frombuffer(bytearray(v3), dtype=torch.uint8))
    assert i3["format_version"] == 3 and i2["raw_bytes"] == i3["raw_bytes"]
    begin = i2["header_bytes"] + (-i2["header_bytes"] % 16)
    raw = slice(begin, begin + i2["raw_bytes"])
    assert v2[raw] == v3[raw]
    if MANIFESTS[2][name]["codec"] == "fixed":
        assert i2["coded_bytes"] and v2[-i2["coded_bytes"]:] == v3[-i3["coded_bytes"]:]
