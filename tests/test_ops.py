"""torch.library registration: the ops run, and their fake implementations agree."""
import torch

import portable_zip as pz
from conftest import fresh_rng, same_bits, weights


def test_ops_roundtrip(coded_dtype):
    t = weights(fresh_rng(), 10_003, coded_dtype).reshape(7, 1429)
    buf = torch.ops.portable_zip.compress(t)
    assert buf.numel() == pz.max_compressed_size(t.numel(), t.dtype, t.dim())
    out = torch.empty_like(t)
    torch.ops.portable_zip.decompress_into(buf, out)
    assert same_bits(out, t)


def test_opcheck():
    t = weights(fresh_rng(), 5000, torch.bfloat16)
    torch.library.opcheck(torch.ops.portable_zip.compress.default, (t,),
                          test_utils=("test_schema", "test_faketensor"))
    buf = torch.ops.portable_zip.compress(t)
    torch.library.opcheck(torch.ops.portable_zip.decompress_into.default, (buf, torch.empty_like(t)),
                          test_utils=("test_schema", "test_faketensor"))


def test_compile_traces_ops():
    def f(x):
        buf = torch.ops.portable_zip.compress(x)
        out = torch.empty_like(x)
        torch.ops.portable_zip.decompress_into(buf, out)
        return out * 2

    t = weights(fresh_rng(), 4096, torch.float32)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(t)
    assert torch.equal(got, t * 2)


def test_opcheck_all_utils():
    """Every opcheck test (schema, autograd registration, fake tensor, AOT
    dispatch): the compress op's padded output must be deterministic, so its
    bytes past the stream are zeros, not leftover memory."""
    rng = fresh_rng()
    # (fp8 is left out: opcheck's schema check multiplies tensors, which torch lacks for fp8 on the CPU.)
    for t in (weights(rng, 5000, torch.bfloat16), weights(rng, 333, torch.float16).reshape(3, 111),
              torch.arange(1000, dtype=torch.int64)):
        torch.library.opcheck(torch.ops.portable_zip.compress.default, (t,))
        buf = torch.ops.portable_zip.compress(t)
        assert not buf[pz.compressed_size(buf):].any()
        torch.library.opcheck(torch.ops.portable_zip.decompress_into.default, (buf, torch.empty_like(t)))
