"""compress / decompress / inspect over torch tensors, CPU or GPU."""
from __future__ import annotations

import contextlib
import functools
import itertools
import numbers
import operator
import threading
from typing import Iterator, Optional, Sequence

import torch

try:
    import portable_zip._C as _C  # absolute: the binding, not the package face
except ImportError as e:  # imported from a source checkout that has no built extension
    raise ImportError("portable_zip's compiled extension is missing: install the package (pip install .) and "
                      "import it from outside the source tree (or run python -P)") from e
from . import checks
from . import device as _device
from .dtypes import CODED, CODEC_CODES, CODECS, DTYPE_TO_CODE, code_of, dtype_of
from .._version import __version__

from .errors import FormatError  # noqa: E402

FORMAT_VERSION = _C.format_version  # the stream format this build writes (it reads every older one too)
MAX_HEADER_BYTES = 32 + 8 * 16
MAX_DIMS = 16
MAX_NUMEL = 1 << 48  # format.h kMaxNumel: byte counts stay far from wrapping 64 bits
_CODED = frozenset(CODED)


_INT_MAX = 2**31 - 1  # the binding's int arguments


def _count(value, name: str) -> int:
    """value as a count the binding takes (1 .. 2**31-1), else ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= _INT_MAX:
        raise ValueError(f"{name} must be a positive int (at most {_INT_MAX}) or None, got {value!r}")
    return int(value)


def _threads(threads: Optional[int]) -> int:
    """The CPU codec's thread count: threads, else torch's (the codec uses at most one per block)."""
    return torch.get_num_threads() if threads is None else _count(threads, "threads")


def _check_tensor(t, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (strides {tuple(t.stride())} for shape {tuple(t.shape)}); "
                         "call .contiguous() first")
    if t.dim() > MAX_DIMS:
        raise ValueError(f"{what} has {t.dim()} dimensions; portable_zip supports at most {MAX_DIMS}")
    if t.is_cuda:  # is_cuda/is_cpu: t.device builds an object, ~10x the cost
        if _device._loaded is None:
            _device.require()  # loads the vendor runtime and kernels, or says what is missing
    elif not t.is_cpu:
        raise ValueError(f"{what} is on device {t.device}; portable_zip handles cpu and cuda (CUDA or ROCm) tensors")


def _plain_gpu(t) -> bool:
    """Whether t passes _check_tensor and check_out as a loaded GPU's tensor,
    in one expression: callers run the full checks (and their messages, in
    their order) only when it is False."""
    return (isinstance(t, torch.Tensor) and t.is_cuda and _device._loaded is not None and t.is_contiguous()
            and t.dim() <= MAX_DIMS and not t.is_conj() and not t.is_neg())


def _plain_stream(b) -> bool:
    """Whether b passes _header_args (callers run it when this is False)."""
    return isinstance(b, torch.Tensor) and b.dtype is torch.uint8 and b.dim() == 1 and b.is_contiguous()


# Per-tensor calls mapped over a batch at C speed (no Python frame per tensor).
_T = torch.Tensor
_DATA_PTR, _NUMEL, _DIM, _IS_CONTIGUOUS, _GET_DEVICE = _T.data_ptr, _T.numel, _T.dim, _T.is_contiguous, _T.get_device
_NBYTES, _DTYPE, _SHAPE, _IS_CUDA = map(operator.attrgetter, ("nbytes", "dtype", "shape", "is_cuda"))


def _plain_streams(bufs: list) -> bool:
    """Whether every stream passes _header_args (the batch form of _plain_stream)."""
    n = len(bufs)
    return (all(map(isinstance, bufs, itertools.repeat(_T, n))) and all(map(_IS_CONTIGUOUS, bufs))
            and set(map(_DIM, bufs)) <= {1} and set(map(_DTYPE, bufs)) <= {torch.uint8})


def _plain_outs(bufs: list, outs: list) -> bool:
    """Whether every output is a plain GPU tensor (_plain_gpu) on its stream's
    device: each passes _check_outs' own checks, leaving the overlap test."""
    n = len(outs)
    return (_device._loaded is not None and all(map(isinstance, outs, itertools.repeat(_T, n)))
            and all(map(_IS_CUDA, outs)) and all(map(_IS_CONTIGUOUS, outs))
            and max(map(_DIM, outs), default=0) <= MAX_DIMS and not any(map(_T.is_conj, outs))
            and not any(map(_T.is_neg, outs)) and list(map(_GET_DEVICE, outs)) == list(map(_GET_DEVICE, bufs)))


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values: a lazy conj or neg view (t.conj(), torch._neg_view)
    keeps the original bits in memory plus a flag, so raw-pointer code must
    read a materialized copy."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def check_out(out: torch.Tensor, what: str = "out") -> None:
    _check_tensor(out, what)
    if out.is_conj() or out.is_neg():
        raise ValueError(f"{what} is a lazy {'conj' if out.is_conj() else 'neg'} view: decoding into its memory would "
                         "store values it then shows conjugated/negated; pass a plain tensor (e.g. torch.empty_like)")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte of memory."""
    if a.device != b.device:
        return False
    na, nb = a.nbytes, b.nbytes
    if not na or not nb:
        return False
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + nb and pb < pa + na


def _any_overlap(bufs: Sequence[torch.Tensor], outs: Sequence[Optional[torch.Tensor]]) -> bool:
    """False when no output shares memory with a stream or another output
    (streams may share memory: they are only read); True when one may (the
    caller's pairwise overlaps loop decides), in O(n log n). First by address
    alone: n spans are disjoint iff, with starts and ends sorted apart, each
    start is at or past the end ranked before it (C-speed passes, no pairs
    built). Only if not, the spans sorted by (device index, start): a span
    overlaps an earlier one iff it starts before the furthest end so far (of
    any span, for an output; of an output's, for a stream)."""
    ts = [t for t in itertools.chain(bufs, outs) if t is not None]
    sizes = list(map(_NBYTES, ts))
    starts = list(map(_DATA_PTR, ts))
    if 0 in sizes:  # empty tensors share no byte
        starts = [p for p, n in zip(starts, sizes) if n]
        sizes = [n for n in sizes if n]
    ends = sorted(map(operator.add, starts, sizes))
    starts.sort()
    if not any(map(operator.lt, itertools.islice(starts, 1, None), ends)):
        return False
    spans = []
    for ts, is_out in ((bufs, False), (outs, True)):
        for t in ts:
            if t is not None and (n := t.nbytes):
                p = t.data_ptr()
                spans.append((t.get_device(), p, p + n, is_out))
    spans.sort()
    dev, end_any, end_out = None, 0, 0
    for d, start, end, is_out in spans:
        if d != dev:
            dev, end_any, end_out = d, 0, 0
        if start < (end_any if is_out else end_out):
            return True
        end_any = max(end_any, end)
        if is_out:
            end_out = max(end_out, end)
    return False


def _plan(t: torch.Tensor):
    return code_of(t.dtype), t.numel(), t.shape  # the binding takes a torch.Size as a list


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
    """The current device's current stream (raw handle)."""
    return _device.stream(_device.current())


_SAME_DEVICE = contextlib.nullcontext()


def _on(index: int):
    """Context for a launch on device index. The launchers make that device
    current themselves; torch.cuda.device puts the caller's back afterwards,
    needed only when it differs (entering it costs microseconds)."""
    return _SAME_DEVICE if _device.current() == index else torch.cuda.device(index)


_WS_KEPT_MAX = 1 << 20  # bytes: workspaces up to this size are kept for the next call


class _Kept(threading.local):
    def __init__(self):
        self.ws: dict = {}  # (device index, stream) -> workspace


_kept = _Kept()


def _workspace(index: int, stream: int, nbytes: int) -> torch.Tensor:
    """A uint8 buffer of at least nbytes on GPU index for the copies and kernels
    a call queues on stream (the raw handle of that device's current stream).
    Small ones are kept per (thread, device, stream) and reused: a call's
    queued work uses its workspace only on that stream, so the next call's,
    queued behind it, cannot race it. Per thread, as nothing makes one call's
    table copy and launch atomic against another thread's on the same stream.
    A kept buffer that is outgrown goes back to the caching allocator, which
    reuses its block only on the stream it was allocated on: ordered too.
    Larger ones, and any under graph capture (which fixes the address a
    replay writes), are allocated per call, as before."""
    if nbytes > _WS_KEPT_MAX or _device.capturing():
        return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
    kept = _kept.ws
    key = (index, stream)
    ws = kept.get(key)
    if ws is None or ws.numel() < nbytes:
        ws = kept[key] = torch.empty(1 << max(12, (nbytes - 1).bit_length()), dtype=torch.uint8,
                                     device=torch.device("cuda", index))
    return ws


class _Budget(threading.local):
    max_sms: Optional[int] = None  # a class default: getattr(local, name, None) on a miss costs an exception


_budget = _Budget()


@contextlib.contextmanager
def sm_budget(max_sms: Optional[int]) -> Iterator[None]:
    """Limit GPU compress/decompress in this thread to max_sms SMs (None: all),
    so the codec can share the GPU with compute running beside it.
    The budget is thread-local: work handed to a thread pool does not see it,
    so code that runs the codec on other threads (the comm layer's workers)
    passes max_sms to each call explicitly (compress_padded, compress_batch,
    decode_queued, _queue_decodes take it)."""
    max_sms = None if max_sms is None else _count(max_sms, "max_sms")
    old = _budget.max_sms
    _budget.max_sms = max_sms
    try:
        yield
    finally:
        _budget.max_sms = old


def max_sms_in_force(max_sms: Optional[int]) -> int:
    """The SM limit for one call (0 = all): the argument, else the sm_budget in force."""
    if max_sms is None:
        max_sms = _budget.max_sms
    return 0 if max_sms is None else _count(max_sms, "max_sms")


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
    nbytes = t.nbytes
    if t.is_cpu and nbytes >= _HUGE_MIN:
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


def compress_padded(t: torch.Tensor, threads: Optional[int] = None, max_sms: int = 0, codec: int = 1,
                     zero_pad: bool = False) -> torch.Tensor:
    """Compress into a buffer of max_compressed_size bytes; the header holds the true size.
    max_sms: the GPU launch's SM limit, 0 for all (no sm_budget is read here).
    zero_pad: the bytes past the stream are zeros (a deterministic buffer, as the torch op promises)."""
    t, code, numel, shape = _planned(t)
    cap = _C.max_compressed_size(code, numel, shape)
    device = t.device
    if t.is_cpu:
        out = _fresh(cap, torch.uint8, device)
        total = _C.compress_cpu(t.data_ptr(), code, numel, shape, out.data_ptr(), _threads(threads), codec)
        if zero_pad:  # it writes every byte of the stream; past it, bytes are left over (segments are staged there)
            out[total:].zero_()
        return out
    out = (torch.zeros if zero_pad else torch.empty)(cap, dtype=torch.uint8, device=device)
    dev = device.index
    stream = _device.stream(dev)
    with _on(dev):
        # Raw-stored tensors go through a kernel too: it copies and computes the payload's checksums.
        ws = _workspace(dev, stream, _C.compress_workspace_bytes(code, numel, shape, codec, dev))
        _C.compress_gpu(t.data_ptr(), code, numel, shape, out.data_ptr(), ws.data_ptr(), stream, max_sms, codec, dev)
    return out


def compressed_size(buf: torch.Tensor) -> int:
    """Bytes of the stream in buf (reads its header; synchronizes for GPU buffers)."""
    return int(_header(buf)[1]["total_bytes"])


def size_field(buf: torch.Tensor) -> torch.Tensor:
    """The 8 bytes of stream buffer buf that hold the stream's total size (a
    little-endian u64, header included), as a uint8 view on buf's device:
    buf[_C.total_bytes_offset : _C.total_bytes_offset + 8]. This is how
    callers learn a GPU stream's size without parsing header bytes or a host
    sync: copy the view where it is needed (into a pinned buffer with
    non_blocking=True, beside other streams' fields), or hand it to a
    transport that reads it on the device. The field is written with the
    stream, so it is valid once the compress that wrote buf has run."""
    _header_args(buf)
    at = _C.total_bytes_offset
    if buf.numel() < at + 8:
        raise ValueError(f"a {buf.numel()}-byte buffer is too short to hold a stream's size field "
                         f"(bytes {at} to {at + 8})")
    return buf[at: at + 8]


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
    sms, code = max_sms_in_force(max_sms), _codec_code(codec)
    if threads is not None:  # checked wherever the call runs (GPU calls ignore it)
        _count(threads, "threads")
    if trim is not False and isinstance(t, torch.Tensor) and t.is_cpu and t.nbytes > _MAPPED_MIN:
        return _compress_exact_cpu(t, threads, code)
    buf = compress_padded(t, threads, sms, code)
    if trim is None:
        trim = buf.is_cpu
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
    if buf.is_cpu:
        head = buf[:n].numpy().tobytes()
    else:
        since = checks.mark()
        head = buf[:n].cpu().numpy().tobytes()
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
    sms = max_sms_in_force(max_sms)
    if threads is not None:
        _count(threads, "threads")
    if out is not None and isinstance(buf, torch.Tensor) and buf.is_cuda:
        if not _plain_stream(buf):
            _header_args(buf)
        if not _plain_gpu(out):
            check_out(out)  # on a GPU, it loaded the GPU code (_device.require)
        if out.get_device() != buf.get_device():
            raise ValueError(f"out is on {out.device} but the stream is on {buf.device}")
        # overlaps, for two tensors on one device
        pb, nb, po, no = buf.data_ptr(), buf.numel(), out.data_ptr(), out.nbytes
        if nb and no and pb < po + no and po < pb + nb:
            raise ValueError("out overlaps the stream's memory: decoding would overwrite the stream while reading it")
        failed = _queue_decodes((buf,), (out,), check, sms)
        if failed:
            raise FormatError(f"decompress: {failed[0][1]}")
        return out
    head, info, out = _target(buf, out)
    if buf.is_cpu:
        _C.decompress_cpu(head, buf.data_ptr(), buf.numel(), out.data_ptr(), _threads(threads))
        return out
    _check_tensor(buf, "stream")
    err = torch.zeros(1, dtype=torch.int32, device=buf.device)
    decode_queued(buf, head, info, out, err, sms)
    bits = int(err.item())
    if bits:
        raise FormatError(_C.decode_error_text(bits))
    return out


def _target(buf: torch.Tensor, out: Optional[torch.Tensor], what: str = "out", stream: str = "the stream") -> tuple:
    """buf's header (head, info) and the tensor its decode fills: out, once
    checked against the header (ValueError naming what), else a new one.
    FormatError where the header is bad."""
    head, info = _header(buf)
    dtype = dtype_of(info["dtype"])
    shape = tuple(info["shape"])
    if out is None:
        return head, info, _fresh(shape, dtype, buf.device)
    check_out(out, what)
    if out.dtype != dtype or tuple(out.shape) != shape:
        raise ValueError(f"{what} is {out.dtype}{list(out.shape)} but {stream} holds {dtype}{list(shape)}")
    if out.device != buf.device:
        raise ValueError(f"{what} is on {out.device} but {stream} is on {buf.device}")
    if overlaps(out, buf):
        raise ValueError(f"{what} overlaps {stream}'s memory: decoding would overwrite it while reading it")
    return head, info, out


def _failed_streams(what: str, failed: list, queued: bool = False) -> FormatError:
    """One error for a batch's failed decodes, failed: [(stream index, why)]:
    which streams, why, and what the outputs hold (e.streams: the indices).
    queued: some GPU decodes were queued unchecked (out=, check=False)."""
    failed = sorted(failed)
    idx = [i for i, _ in failed]
    names = ", ".join(map(str, idx))
    whys = "; ".join(f"stream {i}: {why}" for i, why in failed[:4]) + ("; ..." if len(failed) > 4 else "")
    e = FormatError(f"{what}: stream{'s' if len(idx) > 1 else ''} {names} failed ({whys}); the outputs of the other "
                    f"streams hold their decoded data, output{'s' if len(idx) > 1 else ''} {names} "
                    f"{'are' if len(idx) > 1 else 'is'} unspecified" +
                    ("; GPU decodes queued into out= hold theirs once done, and pz.check() reports their errors"
                     if queued else ""))
    e.streams = idx
    return e


# Which device-parsed decode kernel serves outputs of a dtype: its own for an
# entropy-coded dtype, one shared by every dtype stored raw.
_KERNEL_KEYS = {d: code_of(d) if d in CODED else "raw" for d in DTYPE_TO_CODE}


def _grouped(keys: list) -> dict:
    """key -> the indices (ascending) of keys holding it, None keys left out.
    Batches are mostly of one key: that case costs one count."""
    if keys and keys[0] is not None and keys.count(keys[0]) == len(keys):
        return {keys[0]: list(range(len(keys)))}
    groups: dict = {}
    for i, k in enumerate(keys):
        if k is not None:
            groups.setdefault(k, []).append(i)
    return groups


def _pick(xs: Sequence, idx: list) -> Sequence:
    """xs at the ascending indices idx (xs itself when idx is all of them)."""
    return xs if len(idx) == len(xs) else [xs[i] for i in idx]


def _queue_decodes(bufs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], check: bool, max_sms: int,
                   what: str = "decompress", labels: Optional[Sequence[int]] = None) -> list:
    """Queue the decodes of GPU streams bufs[i] into outs[i] (one device,
    inputs validated), one launch per decode kernel, with no host sync. The
    kernels parse the headers. max_sms: the launches' SM limit, 0 for all.
    check: wait and raise now; else each decode's error word is registered
    for the next check (checks.py). Errors name what, or "what stream i"
    for decode j when labels[j] = i."""
    dev = bufs[0].get_device()
    stream = _device.stream(dev)
    n = len(bufs)
    # The binding's per-decode lists. A loop appending to them costs twice what
    # mapped calls do, and those more than literals do for decompress's one.
    if n == 1:
        (b,), (o,) = bufs, outs
        ins, lens, ptrs = [b.data_ptr()], [b.numel()], [o.data_ptr()]
        dtypes, numels, shapes = [o.dtype], [o.numel()], [o.shape]
        aligned = not ins[0] % 16
    else:
        ins, lens = list(map(_DATA_PTR, bufs)), list(map(_NUMEL, bufs))
        ptrs, dtypes = list(map(_DATA_PTR, outs)), list(map(_DTYPE, outs))
        numels, shapes = list(map(_NUMEL, outs)), list(map(_SHAPE, outs))
        aligned = not functools.reduce(operator.or_, ins) % 16
    if not aligned:  # the decoder reads 16-byte-aligned segments
        # The copies live until queued: then the caching allocator reuses their blocks only behind this work.
        bufs = [b.clone() if p % 16 else b for b, p in zip(bufs, ins)]
        ins = list(map(_DATA_PTR, bufs))
    if n == 1 or dtypes.count(dtypes[0]) == n:  # one dtype: one launch (the common case, kept short)
        codes, groups = [code_of(dtypes[0])] * n, [range(n)]
    else:
        codes = [code_of(d) for d in dtypes]
        groups = list(_grouped([_KERNEL_KEYS[d] for d in dtypes]).values())  # one launch per decode kernel
    if check:
        errs = torch.zeros(n, dtype=torch.int32, device=bufs[0].device)
        words = list(range(errs.data_ptr(), errs.data_ptr() + 4 * n, 4))
    else:
        slab, k0, w0 = checks.slots(dev, stream, n)
        words = list(range(w0, w0 + 4 * n, 4))
    jobs = (ins, lens, ptrs, words, codes, numels, shapes)
    with _on(dev):
        for idx in groups:
            ws = _workspace(dev, stream, _C.decode_batch_workspace_bytes(len(idx)))
            _C.decode_gpu_batch(*(jobs if len(idx) == n else [_pick(x, idx) for x in jobs]), ws.data_ptr(), stream,
                                max_sms, dev)
            if not check:  # registered once queued: no check reads them before
                checks.register(dev, stream, slab, _pick(range(k0, k0 + n), idx), what,
                                None if labels is None else _pick(labels, idx))
    if not check:
        return []
    bits = errs.cpu().tolist()
    return [(i if labels is None else labels[i], _C.decode_error_text(w)) for i, w in enumerate(bits) if w]


def decode_queued(buf: torch.Tensor, head: bytes, info: dict, out: torch.Tensor, err: torch.Tensor,
                max_sms: int = 0) -> None:
    """Queue the decode of GPU stream buf (header already parsed: head, info)
    into out on the current stream, without a host sync; decode errors OR
    their bits into err (int32 on the device), read when the caller syncs.
    max_sms: the launch's SM limit, 0 for all (no sm_budget is read here)."""
    if buf.data_ptr() % 16:
        buf = buf.clone()  # the decoder reads 16-byte-aligned segments
    dev = buf.device.index
    with _on(dev):
        # Raw streams too: the kernel verifies the payload's checksums (and bools) as it copies.
        _C.decompress_gpu(head, buf.data_ptr(), buf.numel(), out.data_ptr(), err.data_ptr(), _device.stream(dev),
                          max_sms, dev)


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
    (each view padded to max_compressed_size; the headers hold the sizes).
    max_sms: as for compress(); threads that do not carry the caller's
    sm_budget (a pool's) pass it explicitly."""
    sms, codec_id = max_sms_in_force(max_sms), _codec_code(codec)
    if threads is not None:
        _count(threads, "threads")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not _plain_gpu(t):  # a plain GPU tensor needs no resolving
            _check_tensor(t, f"tensors[{i}]")
            tensors[i] = _resolved(t)
    # One launch per (device, dtype) for 16-byte-aligned coded GPU tensors (a coded dtype
    # with elements is what plan_header codes: _C.raw_header(...) is None); the rest one by one.
    keys = [(t.get_device(), t.dtype) if t.is_cuda and t.dtype in _CODED and t.numel() and not t.data_ptr() % 16
            else None for t in tensors]
    out = [None if k else compress_padded(t, threads, sms, codec_id) for t, k in zip(tensors, keys)]
    for (dev, dtype), idx in _grouped(keys).items():
        group = _pick(tensors, idx)
        device, code = group[0].device, code_of(dtype)
        numels = [t.numel() for t in group]
        shapes = [t.shape for t in group]
        cap_of = dict.fromkeys(shapes)  # shape -> padded cap: a batch's tensors often share shapes
        for sh in cap_of:
            cap_of[sh] = -(-_C.max_compressed_size(code, sh.numel(), sh) // 16) * 16
        caps = list(map(cap_of.__getitem__, shapes))
        flat = torch.empty(sum(caps), dtype=torch.uint8, device=device)
        at = list(itertools.accumulate(caps, initial=flat.data_ptr()))
        stream = _device.stream(dev)
        with _on(dev):
            ws = _workspace(dev, stream, _C.compress_batch_workspace_bytes(code, numels, shapes, codec_id, dev))
            _C.compress_gpu_batch([t.data_ptr() for t in group], code, numels, shapes, at[:-1], ws.data_ptr(), stream,
                                  sms, codec_id, dev)
        views = flat.split(caps)
        if len(idx) == len(out):
            out = list(views)
        else:
            for i, v in zip(idx, views):
                out[i] = v
    if trim or (trim is None and None in keys):  # only tensors sent one by one can be on the CPU
        out = [_trim(o) if (trim or o.is_cpu) else o for o in out]
    return out


def _check_outs(bufs: list, outs: list) -> None:
    """decompress_batch's out=: each entry None or a valid output on its
    stream's device, none overlapping a stream or another output. Raises the
    error of the first output that has one, in the order the checks had when
    each output was compared with every stream and every output before it
    (the pairwise loop, run only when the sorted scan finds an overlap)."""
    bad = None
    for i, o in enumerate(outs):
        if o is None or (_plain_gpu(o) and o.get_device() == bufs[i].get_device()):
            continue
        try:
            check_out(o, f"out[{i}]")
            if (d := o.get_device()) != bufs[i].get_device() or (d < 0 and o.device != bufs[i].device):
                raise ValueError(f"out[{i}] is on {o.device} but stream {i} is on {bufs[i].device}")
        except (TypeError, ValueError) as e:
            bad = (i, e)  # an overlap of an earlier output comes first
            break
    valid = outs if bad is None else outs[:bad[0]]
    if _any_overlap(bufs, valid):
        for i, o in enumerate(valid):
            if o is None:
                continue
            for j, b in enumerate(bufs):
                if overlaps(o, b):
                    raise ValueError(f"out[{i}] overlaps stream {j}'s memory")
            for j in range(i):
                if outs[j] is not None and overlaps(o, outs[j]):
                    raise ValueError(f"out[{i}] overlaps out[{j}]")
    if bad is not None:
        raise bad[1]


def decompress_batch(bufs: Sequence[torch.Tensor], *, out: Optional[Sequence[torch.Tensor]] = None,
                     threads: Optional[int] = None, max_sms: Optional[int] = None, check: bool = False) -> list:
    """decompress() over many streams, optionally into preallocated outputs.
    GPU streams decode in one launch per (device, dtype) (every dtype stored
    raw shares one), their headers parsed by the kernels. With out=, the
    launches are queued and errors reported as for decompress(out=) (check=True:
    now). Without out= (or where an entry of out is None), the GPU headers are
    read in one copy per device first, and the results are checked before the
    call returns. A stream that fails does not stop the others: the error
    (FormatError, its .streams the failed indices) names every stream that
    failed where it is checked; the other outputs hold their decoded data."""
    sms = max_sms_in_force(max_sms)
    if threads is not None:
        _count(threads, "threads")
    bufs = list(bufs)
    if out is not None and len(out) != len(bufs):
        raise ValueError(f"got {len(bufs)} streams but {len(out)} outputs")
    outs = list(out) if out is not None else [None] * len(bufs)
    if out is not None and _plain_streams(bufs) and _plain_outs(bufs, outs):  # the usual case, checked at C speed
        if _any_overlap(bufs, outs):
            _check_outs(bufs, outs)  # names the first overlapping pair
    else:
        for b in bufs:
            if not _plain_stream(b):
                _header_args(b)
        if out is not None:  # no output may overwrite a stream or another output
            _check_outs(bufs, outs)
    devs = [b.get_device() if b.is_cuda else None for b in bufs]
    if devs.count(None) < len(devs):
        _device.require()  # what _check_tensor adds to _header_args for a GPU stream
    # A stream that fails fails alone: the others still decode, and one
    # error names the failed ones. Bad arguments raise before any decode.
    failed, heads = [], {}
    for i in [i for i, d in enumerate(devs) if d is None]:
        try:
            heads[i], _, outs[i] = _target(bufs[i], outs[i], f"out[{i}]", f"stream {i}")
        except FormatError as e:
            failed.append((i, str(e)))
    for i, head in heads.items():
        try:
            _C.decompress_cpu(head, bufs[i].data_ptr(), bufs[i].numel(), outs[i].data_ptr(), _threads(threads))
        except FormatError as e:
            failed.append((i, str(e)))
    queued = False
    for idx in _grouped(devs).values():  # the GPU streams of one device
        device = bufs[idx[0]].device
        need = [i for i in idx if outs[i] is None]
        if need:  # one header copy for the device's streams that have no output yet
            since = checks.mark()
            raw = torch.cat([bufs[i][:MAX_HEADER_BYTES] for i in need]).cpu().numpy().tobytes()
            checks.check_synced(device, since)
            at = 0
            for i in need:
                n = min(bufs[i].numel(), MAX_HEADER_BYTES)
                try:
                    info = _C.parse_header(raw[at:at + n], bufs[i].numel())
                    outs[i] = torch.empty(info["shape"], dtype=dtype_of(info["dtype"]), device=device)
                except FormatError as e:
                    failed.append((i, str(e)))
                at += n
            idx = [i for i in idx if outs[i] is not None]
        # Outputs this call allocated make it a synchronizing call: it checks before returning.
        synced = check or bool(need)
        queued = queued or not synced
        if idx:
            failed += _queue_decodes(_pick(bufs, idx), _pick(outs, idx), synced, sms, "decompress_batch", idx)
    if failed:
        raise _failed_streams("decompress_batch", failed, queued)
    return outs


def backend_info(device: Optional[int] = None) -> dict:
    """What this build carries and uses: the GPU vendor torch runs on
    ("backend": cuda, hip or cpu when the build has no code for it), the
    device code per vendor, and the device's warp size."""
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


def stream_layout(t: torch.Tensor) -> dict:
    """Where t's stream keeps its parts: its header's bytes ("raw_begin") and
    the most the whole stream can take ("max_total"), from t's dtype and size."""
    return _C.stream_layout(code_of(t.dtype), t.numel(), [t.numel()])


def parse_header(head: bytes, max_total: int) -> dict:
    """A stream header's fields (dtype code, numel, total_bytes, ...); FormatError
    when it is malformed or claims more than max_total bytes."""
    return _C.parse_header(head, max_total)


def decode_error_text(bits: int) -> str:
    """What the error bits a queued decode ORed into its err tensor mean."""
    return _C.decode_error_text(bits)
