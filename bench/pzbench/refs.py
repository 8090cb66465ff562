"""The reference GPU codecs we measure beside ours, behind one small interface.

Each adapter takes a list of same-size input tensors (rotated so no rep hits
L2) and returns (compress(i), decompress(i), compressed_bytes): the two
callables enqueue one call on the current stream with every buffer allocated
beforehand and no host synchronization, so device events time the kernels.

Setup, as each reference is fastest and fair:
  nvCOMP 6.0 (nvidia-nvcomp-cu13 with nvidia-libnvcomp-cu13, its lib64 on
    LD_LIBRARY_PATH): Codec(algorithm="ANS", data_type="<f2"). The "<f2" hint
    matters: ANS without it gives ratio 0.81 on bf16 weights instead of 0.685.
    Its allocations go to torch's caching allocator (allocating its own output
    on every call, it compresses about 2x slower at 64 MiB and up), and the
    decompression config comes from the compression config, so decode does
    not synchronize.
  DietGPU (facebookresearch/dietgpu a4d70a14, built by
    bench/ref/build_dietgpu.sh): torch.ops.dietgpu.compress_data and
    decompress_data with preallocated temporary memory.
"""
from __future__ import annotations

import os
from typing import Callable, List, Tuple

import torch

Prepared = Tuple[Callable[[int], None], Callable[[int], None], int]


def ours(inputs: List[torch.Tensor], max_sms=None, codec_name: str = "rans") -> Prepared:
    import portable_zip as pz
    from portable_zip import _C
    from portable_zip.codec import streams as codec

    codec_id = codec._codec_code(codec_name)
    bufs = [pz.compress(t, codec=codec_name) for t in inputs]
    outs = [torch.empty_like(t) for t in inputs]
    for t, b, o in zip(inputs, bufs, outs):
        pz.decompress(b, out=o, check=True)
        assert torch.equal(o.view(torch.uint8), t.view(torch.uint8)), "round trip"
    t0 = inputs[0]
    code, numel, shape = codec._plan(t0)
    cap = _C.max_compressed_size(code, numel, shape)
    cbufs = [torch.empty(cap, dtype=torch.uint8, device=t0.device) for _ in inputs]
    ws = torch.empty(_C.compress_workspace_bytes(code, numel, shape), dtype=torch.uint8, device=t0.device)
    heads = [codec._header(b)[0] for b in bufs]
    err = torch.zeros(1, dtype=torch.int32, device=t0.device)
    sms = codec.max_sms_in_force(max_sms)

    def comp(i: int) -> None:
        k = i % len(inputs)
        _C.compress_gpu(inputs[k].data_ptr(), code, numel, shape, cbufs[k].data_ptr(), ws.data_ptr(),
                        codec._stream(), sms, codec_id)

    def decomp(i: int) -> None:
        k = i % len(inputs)
        _C.decompress_gpu(heads[k], bufs[k].data_ptr(), bufs[k].numel(), outs[k].data_ptr(), err.data_ptr(),
                          codec._stream(), sms)

    return comp, decomp, pz.compressed_size(bufs[0])


class _TorchBuffer:
    """A device allocation nvCOMP asks for, served by torch's caching allocator."""

    def __init__(self, nbytes: int, device: torch.device):
        self.t = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)
        self.ptr = self.t.data_ptr()


def nvcomp_ans(inputs: List[torch.Tensor]) -> Prepared:
    from nvidia import nvcomp

    dev = inputs[0].device
    nvcomp.set_device_allocator(lambda nbytes, stream=None: _TorchBuffer(nbytes, dev))
    codec = nvcomp.Codec(algorithm="ANS", data_type="<f2", cuda_stream=torch.cuda.current_stream().cuda_stream)
    nbytes = inputs[0].numel() * inputs[0].element_size()
    arrays = [nvcomp.as_array(t.reshape(-1).view(torch.uint8)) for t in inputs]
    cap = int(codec.get_max_comp_buffer_size(arrays[0]))
    ccfg = codec.compression_config(nbytes)
    dcfg = codec.decompression_config(ccfg)
    cbufs = [torch.empty(cap, dtype=torch.uint8, device=dev) for _ in inputs]
    couts = [nvcomp.as_array(b) for b in cbufs]
    encoded = [codec.encode(a, out=o, compression_config=ccfg) for a, o in zip(arrays, couts)]
    outs = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in inputs]
    douts = [nvcomp.as_array(o) for o in outs]
    for e, o in zip(encoded, douts):
        codec.decode(e, out=o, decompression_config=dcfg)
    torch.cuda.synchronize()
    for o, t in zip(outs, inputs):
        assert torch.equal(o, t.reshape(-1).view(torch.uint8)), "nvCOMP round trip"
    size = _array_bytes(encoded[0])

    def comp(i: int) -> None:
        k = i % len(inputs)
        codec.encode(arrays[k], out=couts[k], compression_config=ccfg)

    def decomp(i: int) -> None:
        k = i % len(inputs)
        codec.decode(encoded[k], out=douts[k], decompression_config=dcfg)

    return comp, decomp, size


def _array_bytes(a) -> int:
    for attr in ("buffer_size", "size"):
        v = getattr(a, attr, None)
        if isinstance(v, int):
            return v * (getattr(a, "item_size", 1) if attr == "size" else 1)
    return int(a.shape[0])


def dietgpu_float(inputs: List[torch.Tensor]) -> Prepared:
    lib = os.environ.get("PZ_DIETGPU_LIB")
    if not lib or not os.path.exists(lib):
        raise RuntimeError("DietGPU is not built: set PZ_DIETGPU_LIB to libdietgpu.so (bench/ref/build_dietgpu.sh)")
    torch.ops.load_library(lib)
    ops = torch.ops.dietgpu
    dev = inputs[0].device
    temp = torch.empty(max(512 << 20, 2 * inputs[0].numel() * inputs[0].element_size()), dtype=torch.uint8,
                       device=dev)
    rows, cols = ops.max_float_compressed_output_size([inputs[0]])
    comps = [torch.empty([rows, cols], dtype=torch.uint8, device=dev) for _ in inputs]
    sizes = [torch.zeros([1], dtype=torch.int, device=dev) for _ in inputs]
    outs = [torch.empty_like(t) for t in inputs]
    status = torch.empty([1], dtype=torch.uint8, device=dev)
    out_sizes = torch.empty([1], dtype=torch.int32, device=dev)
    for k, t in enumerate(inputs):
        ops.compress_data(True, [t], False, temp, comps[k], sizes[k])
    views = [[c[0]] for c in comps]
    for k in range(len(inputs)):
        ops.decompress_data(True, views[k], [outs[k]], False, temp, status, out_sizes)
    torch.cuda.synchronize()
    for o, t in zip(outs, inputs):
        assert torch.equal(o.view(torch.uint8), t.view(torch.uint8)), "DietGPU round trip"

    def comp(i: int) -> None:
        k = i % len(inputs)
        ops.compress_data(True, [inputs[k]], False, temp, comps[k], sizes[k])

    def decomp(i: int) -> None:
        k = i % len(inputs)
        ops.decompress_data(True, views[k], [outs[k]], False, temp, status, out_sizes)

    return comp, decomp, int(sizes[0].item())


def ours_fixed(inputs: List[torch.Tensor], max_sms=None) -> Prepared:
    return ours(inputs, max_sms, "fixed")


def ours_api(inputs: List[torch.Tensor], max_sms=None) -> Prepared:
    """The public calls as a user makes them, neither synchronizing:
    pz.compress(t) (workspace memset + one launch) and pz.decompress(buf,
    out=o) (the kernel parses the header; its error word is checked later)."""
    import portable_zip as pz

    bufs = [pz.compress(t, max_sms=max_sms) for t in inputs]
    outs = [torch.empty_like(t) for t in inputs]
    for t, b, o in zip(inputs, bufs, outs):
        pz.decompress(b, out=o, max_sms=max_sms)
        pz.check()
        assert torch.equal(o.view(torch.uint8), t.view(torch.uint8)), "round trip"

    def comp(i: int) -> None:
        pz.compress(inputs[i % len(inputs)], max_sms=max_sms)

    def decomp(i: int) -> None:
        k = i % len(inputs)
        pz.decompress(bufs[k], out=outs[k], max_sms=max_sms)

    return comp, decomp, pz.compressed_size(bufs[0])


def ours_unaligned(inputs: List[torch.Tensor], max_sms=None) -> Prepared:
    """ours on views that start one element into their allocation: inputs not
    16-byte aligned, which take the unaligned compress kernels."""
    views = []
    for t in inputs:
        v = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
        views.append(v.copy_(t.reshape(-1)))
    assert views[0].data_ptr() % 16 != 0
    return ours(views, max_sms)


def ours_batch(inputs: List[torch.Tensor], max_sms=None, count: int = 64) -> Prepared:
    """compress_batch of `count` tensors, each the size of one input: one launch per call."""
    import portable_zip as pz

    sets = [[inputs[(k * count + i) % len(inputs)].clone() for i in range(count)] for k in range(3)]
    bufs = pz.compress_batch(sets[0])
    for t, b in zip(sets[0], bufs):
        assert torch.equal(pz.decompress(b).view(torch.uint8), t.view(torch.uint8)), "batch round trip"
    size = sum(pz.compressed_size(b) for b in bufs)

    def comp(i: int) -> None:
        pz.compress_batch(sets[i % 3], max_sms=max_sms)

    outs = [[torch.empty_like(t) for t in sets[k]] for k in range(3)]
    streams = [pz.compress_batch(sets[k]) for k in range(3)]
    pz.decompress_batch(streams[0], out=outs[0], check=True)
    assert all(torch.equal(o.view(torch.uint8), t.view(torch.uint8)) for o, t in zip(outs[0], sets[0]))

    def decomp(i: int) -> None:  # one launch, headers parsed on the device
        pz.decompress_batch(streams[i % 3], out=outs[i % 3], max_sms=max_sms)

    return comp, decomp, size / count


SYSTEMS = {"ours": ours, "ours-api": ours_api, "ours-unaligned": ours_unaligned, "ours-batch": ours_batch, "ours-fixed": ours_fixed, "nvcomp": nvcomp_ans, "dietgpu": dietgpu_float}
LABELS = {"ours": "portable_zip rANS", "ours-api": "portable_zip public API (no host sync)", "ours-unaligned": "portable_zip rANS, unaligned inputs", "ours-batch": "portable_zip compress_batch (64 tensors, one launch)", "ours-fixed": "portable_zip fixed", "nvcomp": "nvCOMP 6.0 ANS (<f2)",
          "dietgpu": "DietGPU float"}
