"""compress / decompress / inspect over torch tensors, CPU or GPU."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional, Sequence

import torch

try:
    from . import _C
except ImportError as e:  # imported from a source checkout that has no built extension
    raise ImportError("portable_zip's compiled extension is missing: install the package (pip install .) and "
                      "import it from outside the source tree (or run python -P)") from e
from . import _device, checks
from ._dtypes import CODED, CODEC_CODES, CODECS, code_of, dtype_of

FormatError = _C.FormatError
MAX_HEADER_BYTES = 32 + 8 * 16
MAX_DIMS = 16
MAX_NUMEL = 1 << 48  # format.h kMaxNumel: byte counts stay far from wrapping 64 bits


def _threads(threads: Optional[int]) -> int:
    if threads is None:
        return torch.get_num_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    return threads


def _check_tensor(t, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (strides {tuple(t.stride())} for shape {tuple(t.shape)}); "
                         "call .contiguous() first")
    if t.dim() > MAX_DIMS:
        raise ValueError(f"{what} has {t.dim()} dimensions; portable_zip supports at most {MAX_DIMS}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} is on device {t.device}; portable_zip handles cpu and cuda (CUDA or ROCm) tensors")
    if t.device.type == "cuda":
        _device.require()  # loads the vendor runtime and kernels, or says what is missing


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values: a lazy conj or neg view (t.conj(), torch._neg_view)
    keeps the original bits in memory plus a flag, so raw-pointer code must
    read a materialized copy."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _check_out(out: torch.Tensor, what: str = "out") -> None:
    _check_tensor(out, what)
    if out.is_conj() or out.is_neg():
        raise ValueError(f"{what} is a lazy {'conj' if out.is_conj() else 'neg'} view: decoding into its memory would "
                         "store values it then shows conjugated/negated; pass a plain tensor (e.g. torch.empty_like)")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte of memory."""
    if a.device != b.device:
        return False
    na, nb = a.numel() * a.element_size(), b.numel() * b.element_size()
    if not na or not nb:
        return False
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + nb and pb < pa + na


def _plan(t: torch.Tensor):
    return code_of(t.dtype), t.numel(), list(t.shape)


def max_compressed_size(numel: int, dtype: torch.dtype, ndim: Optional[int] = None) -> int:
    """Worst-case stream bytes for numel elements of dtype (any shape of up to ndim dims)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if numel > MAX_NUMEL:
        raise OverflowError(f"numel {numel} exceeds portable_zip's limit of 2^48 elements per tensor")
    ndim = MAX_DIMS if ndim is None else ndim
    if not 0 <= ndim <= MAX_DIMS:
        raise ValueError(f"ndim must be in [0, {MAX_DIMS}], got {ndim}")
    shape = [1] * ndim
    if ndim:
        shape[0] = numel
    elif numel != 1:
        raise ValueError("a 0-dimensional tensor has exactly one element")
    return _C.max_compressed_size(code_of(dtype), numel, shape)


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


_budget = threading.local()


@contextlib.contextmanager
def sm_budget(max_sms: Optional[int]) -> Iterator[None]:
    """Limit GPU compress/decompress in this thread to max_sms SMs (None: all),
    so the codec can share the GPU with compute running beside it."""
    if max_sms is not None and int(max_sms) < 1:
        raise ValueError(f"max_sms must be >= 1 or None, got {max_sms}")
    old = getattr(_budget, "max_sms", None)
    _budget.max_sms = None if max_sms is None else int(max_sms)
    try:
        yield
    finally:
        _budget.max_sms = old


def _max_sms(max_sms: Optional[int]) -> int:
    """The SM limit for one call (0 = all): the argument, else the sm_budget in force."""
    if max_sms is None:
        max_sms = getattr(_budget, "max_sms", None)
    if max_sms is None:
        return 0
    if int(max_sms) < 1:
        raise ValueError(f"max_sms must be >= 1 or None, got {max_sms}")
    return int(max_sms)


def _codec_code(codec: str) -> int:
    try:
        return CODEC_CODES[codec]
    except (KeyError, TypeError):
        raise ValueError(f"codec must be one of {sorted(CODEC_CODES)}, got {codec!r}") from None


_HUGE_MIN = 4 << 20  # bytes: a fresh CPU buffer this large asks for huge pages
# Bytes of a CPU input past which compress maps its output (no trim copy).
# Smaller buffers come from glibc's heap, reused without page faults (its
# mmap threshold rises to at most 32 MiB), where the copy costs less than
# faulting in a fresh mapping (bench/NOTES.md, s18).
_MAPPED_MIN = 32 << 20


def _fresh(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, with huge pages asked for on large CPU buffers: writing a
    fresh 64 MiB buffer otherwise spends ~20 ms faulting in 4 KiB pages."""
    t = torch.empty(shape, dtype=dtype, device=device)
    nbytes = t.numel() * t.element_size()
    if t.device.type == "cpu" and nbytes >= _HUGE_MIN:
        _C.advise_huge_pages(t.data_ptr(), nbytes)
    return t


def _planned(t: torch.Tensor) -> tuple:
    _check_tensor(t, "input")
    t = _resolved(t)
    return (t, *_plan(t))


def _compress_exact_cpu(t: torch.Tensor, threads: Optional[int], codec: int) -> torch.Tensor:
    """The trimmed stream of a CPU tensor with no trim copy: the buffer is a
    mapping whose pages past the stream are returned once its size is known."""
    t, code, numel, shape = _planned(t)
    return _C.compress_cpu_exact(t.data_ptr(), code, numel, shape, _threads(threads), codec)


def _compress_padded(t: torch.Tensor, threads: Optional[int] = None, max_sms: int = 0, codec: int = 1,
                     zero_pad: bool = False) -> torch.Tensor:
    """Compress into a buffer of max_compressed_size bytes; the header holds the true size.
    zero_pad: the bytes past the stream are zeros (a deterministic buffer, as the torch op promises)."""
    t, code, numel, shape = _planned(t)
    cap = _C.max_compressed_size(code, numel, shape)
    if t.device.type == "cpu":
        out = _fresh(cap, torch.uint8, t.device)
        total = _C.compress_cpu(t.data_ptr(), code, numel, shape, out.data_ptr(), _threads(threads), codec)
        if zero_pad:  # it writes every byte of the stream; past it, bytes are left over (segments are staged there)
            out[total:].zero_()
        return out
    out = (torch.zeros if zero_pad else torch.empty)(cap, dtype=torch.uint8, device=t.device)
    with torch.cuda.device(t.device):
        # Raw-stored tensors go through a kernel too: it copies and computes the payload's checksums.
        ws = torch.empty(_C.compress_workspace_bytes(code, numel, shape, codec, t.device.index), dtype=torch.uint8,
                         device=t.device)
        _C.compress_gpu(t.data_ptr(), code, numel, shape, out.data_ptr(), ws.data_ptr(), _stream(), max_sms, codec,
                        t.device.index)
    return out


def compressed_size(buf: torch.Tensor) -> int:
    """Bytes of the stream in buf (reads its header; synchronizes for GPU buffers)."""
    return int(_header(buf)[1]["total_bytes"])


def _trim(buf: torch.Tensor) -> torch.Tensor:
    n = compressed_size(buf)
    return _fresh(n, torch.uint8, buf.device).copy_(buf[:n])


def trim(buf: torch.Tensor) -> torch.Tensor:
    """The exact-size stream from a padded buffer (a copy, so the padding is freed)."""
    return _trim(buf)


def compress(t: torch.Tensor, *, trim: Optional[bool] = None, threads: Optional[int] = None,
             max_sms: Optional[int] = None, codec: str = "rans") -> torch.Tensor:
    """Compress any tensor into a self-describing uint8 tensor on the same device.

    On CPU the result is trimmed to the stream size. On GPU it is, by default,
    the padded buffer (max_compressed_size bytes; no host synchronization); the
    header carries the true size: see compressed_size(), trim() and inspect().
    max_sms limits a GPU call to that many SMs (default: the sm_budget in force, else all).
    codec="fixed" picks the fixed-length exponent code (7 three-bit codes and an
    escape): a larger stream, simpler and faster to code (bench/NOTES.md says where
    it wins); decompress reads the codec from the header.
    """
    sms, code = _max_sms(max_sms), _codec_code(codec)
    if (trim is not False and isinstance(t, torch.Tensor) and t.device.type == "cpu"
            and t.numel() * t.element_size() > _MAPPED_MIN):
        return _compress_exact_cpu(t, threads, code)
    buf = _compress_padded(t, threads, sms, code)
    if trim is None:
        trim = buf.device.type == "cpu"
    return _trim(buf) if trim else buf


def _header_args(buf) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"stream must be a uint8 torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise TypeError(f"stream must be a 1-D uint8 tensor, got {buf.dtype} with shape {tuple(buf.shape)}")
    if not buf.is_contiguous():
        raise ValueError("stream tensor must be contiguous")


def _header(buf) -> tuple:
    _header_args(buf)
    n = min(buf.numel(), MAX_HEADER_BYTES)
    since = checks.mark()
    head = bytes(buf[:n].cpu().numpy().tobytes())
    checks.check_synced(buf.device, since)  # the copy synchronized this stream: its queued decodes are done
    return head, _C.parse_header(head, buf.numel())


def decompress(buf: torch.Tensor, *, out: Optional[torch.Tensor] = None, threads: Optional[int] = None,
               max_sms: Optional[int] = None, check: bool = False) -> torch.Tensor:
    """Bit-exact inverse of compress: same dtype, shape and device (or into out).

    On the GPU with out=, the decode is queued and the call returns at once:
    the kernel reads the header itself, and a corrupted, truncated or
    mismatched stream is reported at the next synchronizing call of this API
    (pz.check(), or check=True to wait and check now). Without out=, the
    header is read first (a host sync) and the result is checked before the
    call returns. CPU decodes are always checked before they return."""
    sms = _max_sms(max_sms)
    if out is not None and isinstance(buf, torch.Tensor) and buf.device.type == "cuda":
        _header_args(buf)
        _check_out(out)
        if out.device != buf.device:
            raise ValueError(f"out is on {out.device} but the stream is on {buf.device}")
        if _overlap(out, buf):
            raise ValueError("out overlaps the stream's memory: decoding would overwrite the stream while reading it")
        _check_tensor(buf, "stream")
        _queue_decodes([buf], [out], check, sms)
        return out
    head, info = _header(buf)
    dtype = dtype_of(info["dtype"])
    shape = tuple(info["shape"])
    if out is None:
        out = _fresh(shape, dtype, buf.device)
    else:
        _check_out(out)
        if out.dtype != dtype or tuple(out.shape) != shape:
            raise ValueError(f"out is {out.dtype}{list(out.shape)} but the stream holds {dtype}{list(shape)}")
        if out.device != buf.device:
            raise ValueError(f"out is on {out.device} but the stream is on {buf.device}")
        if _overlap(out, buf):
            raise ValueError("out overlaps the stream's memory: decoding would overwrite the stream while reading it")
    if buf.device.type == "cpu":
        _C.decompress_cpu(head, buf.data_ptr(), buf.numel(), out.data_ptr(), _threads(threads))
        return out
    _check_tensor(buf, "stream")
    err = torch.zeros(1, dtype=torch.int32, device=buf.device)
    _decode_gpu(buf, head, info, out, err, sms)
    bits = int(err.item())
    if bits:
        raise FormatError(_C.decode_error_text(bits))
    return out


def _kernel_key(dtype: torch.dtype):
    """Which device-parsed decode kernel serves outputs of dtype: its own for
    an entropy-coded dtype, one shared by every dtype stored raw."""
    return code_of(dtype) if dtype in CODED else "raw"


def _queue_decodes(bufs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], check: bool, max_sms: int,
                   names: Optional[Sequence[str]] = None) -> None:
    """Queue the decodes of GPU streams bufs[i] into outs[i] (one device,
    inputs validated), one launch per decode kernel, with no host sync. The
    kernels parse the headers. check: wait and raise now; else each decode's
    error word is registered for the next check (checks.py)."""
    device = bufs[0].device
    groups: dict = {}
    for i, o in enumerate(outs):
        groups.setdefault(_kernel_key(o.dtype), []).append(i)
    errs = torch.zeros(len(bufs), dtype=torch.int32, device=device) if check else None
    with torch.cuda.device(device):
        for idx in groups.values():
            ins = []
            for i in idx:
                b = bufs[i]
                ins.append(b if b.data_ptr() % 16 == 0 else b.clone())  # the decoder reads 16-byte-aligned segments
            slots = [] if check else [checks.slot(device) for _ in idx]
            words = [errs[i:i + 1] for i in idx] if check else [w for _, _, w in slots]
            ws = torch.empty(_C.decode_batch_workspace_bytes(len(idx)), dtype=torch.uint8, device=device)
            _C.decode_gpu_batch([b.data_ptr() for b in ins], [b.numel() for b in ins],
                                [outs[i].data_ptr() for i in idx], [w.data_ptr() for w in words],
                                [code_of(outs[i].dtype) for i in idx], [outs[i].numel() for i in idx],
                                [list(outs[i].shape) for i in idx], ws.data_ptr(), _stream(), max_sms, device.index)
            for i, (slab, k, _) in zip(idx, slots):  # registered once queued: no check reads them before
                checks.register(device, slab, k, (names[i] if names else "decompress") + " (queued)")
    if check:
        bits = errs.cpu().tolist()
        failed = [((names[i] if names else "decompress"), w) for i, w in enumerate(bits) if w]
        if failed:
            checks._raise(failed)


def _decode_gpu(buf: torch.Tensor, head: bytes, info: dict, out: torch.Tensor, err: torch.Tensor,
                max_sms: int = 0) -> None:
    """Queue the decode of GPU stream buf (header already parsed: head, info)
    into out on the current stream, without a host sync; decode errors OR
    their bits into err (int32 on the device), read when the caller syncs."""
    if buf.data_ptr() % 16:
        buf = buf.clone()  # the decoder reads 16-byte-aligned segments
    with torch.cuda.device(buf.device):
        # Raw streams too: the kernel verifies the payload's checksums (and bools) as it copies.
        _C.decompress_gpu(head, buf.data_ptr(), buf.numel(), out.data_ptr(), err.data_ptr(), _stream(), max_sms,
                          buf.device.index)


def inspect(buf: torch.Tensor) -> dict:
    """Header fields and sizes of a stream, without decoding it."""
    _, info = _header(buf)
    dtype = dtype_of(info["dtype"])
    original = info["numel"] * dtype.itemsize
    total = info["total_bytes"]
    return {
        "format_version": info["version"],
        "dtype": dtype,
        "shape": tuple(info["shape"]),
        "codec": CODECS[info["codec"]],
        "compressed_bytes": total,
        "original_bytes": original,
        "ratio": total / original if original else 1.0,
        "raw_bytes": info["raw_end"] - info["raw_begin"],
        "coded_bytes": total - info["coded_begin"] if info["codec"] else 0,
        "header_bytes": info["header_bytes"],
        "blocks": info["nblocks"],
        "block_symbols": info["block_symbols"],
        "lanes": info["lanes"],
        "buffer_bytes": buf.numel(),
    }


def compress_batch(tensors: Sequence[torch.Tensor], *, trim: Optional[bool] = None,
                   threads: Optional[int] = None, max_sms: Optional[int] = None, codec: str = "rans") -> list:
    """compress() over many tensors. On the GPU, the entropy-coded tensors of
    each (device, dtype) go out in one kernel launch, into views of one buffer
    (each view padded to max_compressed_size; the headers hold the sizes)."""
    sms, codec_id = _max_sms(max_sms), _codec_code(codec)
    out: list = [None] * len(tensors)
    groups: dict = {}
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        _check_tensor(t, f"tensors[{i}]")
        tensors[i] = t = _resolved(t)
        # One launch per (device, dtype) for 16-byte-aligned coded GPU tensors.
        if t.device.type == "cuda" and t.data_ptr() % 16 == 0 and _C.raw_header(*_plan(t)) is None:
            groups.setdefault((t.device, t.dtype), []).append(i)
        else:
            out[i] = _compress_padded(t, threads, sms, codec_id)
    for (device, dtype), idx in groups.items():
        code = code_of(dtype)
        numels = [tensors[i].numel() for i in idx]
        shapes = [list(tensors[i].shape) for i in idx]
        caps = [-(-_C.max_compressed_size(code, n, sh) // 16) * 16 for n, sh in zip(numels, shapes)]
        with torch.cuda.device(device):
            flat = torch.empty(sum(caps), dtype=torch.uint8, device=device)
            ws = torch.empty(_C.compress_batch_workspace_bytes(code, numels, shapes, codec_id, device.index),
                             dtype=torch.uint8, device=device)
            views, at = [], 0
            for cap in caps:
                views.append(flat[at: at + cap])
                at += cap
            _C.compress_gpu_batch([tensors[i].data_ptr() for i in idx], code, numels, shapes,
                                  [v.data_ptr() for v in views], ws.data_ptr(), _stream(), sms, codec_id,
                                  flat.device.index)
        for i, v in zip(idx, views):
            out[i] = v
    return [_trim(o) if (trim or (trim is None and o.device.type == "cpu")) else o for o in out]


def decompress_batch(bufs: Sequence[torch.Tensor], *, out: Optional[Sequence[torch.Tensor]] = None,
                     threads: Optional[int] = None, max_sms: Optional[int] = None, check: bool = False) -> list:
    """decompress() over many streams, optionally into preallocated outputs.
    GPU streams decode in one launch per (device, dtype) (every dtype stored
    raw shares one), their headers parsed by the kernels. With out=, the
    launches are queued and errors reported as for decompress(out=) (check=True:
    now). Without out= (or where an entry of out is None), the GPU headers are
    read in one copy per device first, and the results are checked before the
    call returns."""
    sms = _max_sms(max_sms)
    bufs = list(bufs)
    if out is not None and len(out) != len(bufs):
        raise ValueError(f"got {len(bufs)} streams but {len(out)} outputs")
    outs = list(out) if out is not None else [None] * len(bufs)
    for j, b in enumerate(bufs):
        _header_args(b)
    if out is not None:  # no output may overwrite a stream or another output
        for i, o in enumerate(outs):
            if o is None:
                continue
            _check_out(o, f"out[{i}]")
            if o.device != bufs[i].device:
                raise ValueError(f"out[{i}] is on {o.device} but stream {i} is on {bufs[i].device}")
            for j, b in enumerate(bufs):
                if _overlap(o, b):
                    raise ValueError(f"out[{i}] overlaps stream {j}'s memory")
            for j in range(i):
                if outs[j] is not None and _overlap(o, outs[j]):
                    raise ValueError(f"out[{i}] overlaps out[{j}]")
    gpu: dict = {}
    for i, b in enumerate(bufs):
        if b.device.type == "cuda":
            _check_tensor(b, f"stream {i}")
            gpu.setdefault(b.device, []).append(i)
        else:
            outs[i] = decompress(b, out=outs[i], threads=threads)
    for device, idx in gpu.items():
        need = [i for i in idx if outs[i] is None]
        if need:  # one header copy for the device's streams that have no output yet
            since = checks.mark()
            heads = torch.cat([bufs[i][:MAX_HEADER_BYTES] for i in need]).cpu().numpy().tobytes()
            checks.check_synced(device, since)
            at = 0
            for i in need:
                n = min(bufs[i].numel(), MAX_HEADER_BYTES)
                info = _C.parse_header(heads[at:at + n], bufs[i].numel())
                at += n
                outs[i] = torch.empty(tuple(info["shape"]), dtype=dtype_of(info["dtype"]), device=device)
        # Outputs this call allocated make it a synchronizing call: it checks before returning.
        _queue_decodes([bufs[i] for i in idx], [outs[i] for i in idx], check or bool(need), sms,
                       [f"decompress_batch stream {i}" for i in idx])
    return outs


def backend_info(device: Optional[int] = None) -> dict:
    """What this build carries and uses: the GPU vendor torch runs on
    ("backend": cuda, hip or cpu when the build has no code for it), the
    device code per vendor, and the device's warp size."""
    from . import __version__

    v = _device.vendor()
    usable = v != "cpu" and _device.has_code()
    info = {
        "backend": v if usable else "cpu",
        "archs": _device.archs(v) if usable else ["host"],
        "device_code": {"cuda": _device.archs("cuda"), "hip": _device.archs("hip")},
        "version": __version__,
        "format_version": _C.format_version,
        "lanes": _C.lanes,
        "torch": torch.__version__,
        "warp_size": None,
        "device": None,
        # transport="fabric": built in (libfabric headers at build time) and libfabric loadable now.
        "fabric": "available" if not _C.fabric_probe() else "unavailable",
        "fabric_detail": _C.fabric_probe() or "libfabric loads",
        "cpu_simd": _C.cpu_simd(),  # the CPU codec's coder loops: avx2, or scalar (no AVX2, or PZ_CPU_SIMD=0)
    }
    if usable and torch.cuda.is_available():
        _device.require()
        dev = torch.cuda.current_device() if device is None else device
        warp, sms = _C.device_info(dev)
        info.update(warp_size=warp, sm_count=sms, device=torch.cuda.get_device_name(dev),
                    device_image=_C.gpu_image(dev) or None)  # the code file in use, once a kernel has run
    return info
