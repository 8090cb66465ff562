"""Lossless weight deltas: version k+1 of a tensor coded exactly against
version k (docs/FORMAT.md, "Weight-delta streams").

Both ends hold the base (version k). The sender's encode(base, target) makes
a stream; the receiver's apply(base, stream) rebuilds the target in place and
verifies it. Streams are checked before the base is touched (FormatError for
a damaged or relabelled stream, BaseMismatch for a base that is not the
stream's), and the rebuilt tensor is checked after (FormatError: the tensor
no longer holds a known version and needs a full sync). CPU and GPU write
the same bytes and read each other's streams.
"""
from __future__ import annotations

from typing import Optional

import torch

import portable_zip._C as _C
from . import device as _device
from .dtypes import CODED, code_of, dtype_of
from .errors import FormatError, MismatchError
from .streams import check_out, _check_tensor, max_sms_in_force, _on, _threads

__all__ = ["BaseMismatch", "apply", "checksum", "encode", "inspect", "max_encoded_size"]

HEADER_BYTES = _C.delta_header_bytes
VERSION = 1
_MASK32 = 0xFFFFFFFF


class BaseMismatch(MismatchError):
    """The base tensor is not the version the stream was made against (its
    checksum differs from the stream's base checksum); the base is untouched."""


def _check_delta_tensor(t, what: str) -> None:
    check_out(t, what)  # a torch.Tensor, contiguous, on cpu/cuda, not a lazy conj/neg view
    if t.dtype not in CODED:
        raise TypeError(f"{what} has dtype {t.dtype}; deltas code {', '.join(str(d) for d in CODED)}")


def _check_stream(stream) -> None:
    if not isinstance(stream, torch.Tensor):
        raise TypeError(f"stream must be a torch.Tensor, got {type(stream).__name__}")
    if stream.dtype is not torch.uint8 or stream.dim() != 1 or not stream.is_contiguous():
        raise ValueError(f"stream must be a contiguous 1-D uint8 tensor, got {stream.dtype} of shape "
                         f"{tuple(stream.shape)}")
    _check_tensor(stream, "stream")


def _sums(n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(2 * n, dtype=torch.int32, device=device)


def _finish(sums: list, k: int, nbytes: int) -> int:
    return _C.delta_finish_checksum(sums[2 * k] & _MASK32, sums[2 * k + 1] & _MASK32, nbytes)


def _gpu_checksum(p: int, nbytes: int, sums: torch.Tensor, k: int, sms: int) -> None:
    """Queue the checksum sums of nbytes at device pointer p into sums[2k:2k+2]."""
    dev = sums.device.index
    _C.delta_checksum_gpu(p, nbytes, sums.data_ptr() + 8 * k, _device.stream(dev), sms, dev)


def checksum(t: torch.Tensor, *, threads: Optional[int] = None, max_sms: Optional[int] = None) -> int:
    """64-bit checksum of a contiguous tensor's bytes (any dtype); the same
    value on the CPU and the GPU."""
    check_out(t, "t")
    if t.is_cuda:
        sums = _sums(1, t.device)
        with _on(t.device.index):
            _gpu_checksum(t.data_ptr(), t.nbytes, sums, 0, max_sms_in_force(max_sms))
        return _finish(sums.tolist(), 0, t.nbytes)
    return _C.delta_checksum_cpu(t.data_ptr(), t.nbytes, _threads(threads))


def max_encoded_size(numel: int, dtype) -> int:
    """The most bytes encode() can return for numel elements of dtype."""
    if dtype not in CODED:
        raise TypeError(f"deltas code {', '.join(str(d) for d in CODED)}, not {dtype}")
    return _C.delta_max_size(code_of(dtype), int(numel))


def encode(base: torch.Tensor, target: torch.Tensor, *, threads: Optional[int] = None,
           max_sms: Optional[int] = None) -> torch.Tensor:
    """The delta stream that rebuilds target from base: a uint8 tensor on
    target's device, of exactly its size. base and target: same dtype, shape
    and device, contiguous."""
    _check_delta_tensor(base, "base")
    _check_delta_tensor(target, "target")
    if base.dtype != target.dtype or base.shape != target.shape or base.device != target.device:
        raise ValueError(f"base and target differ: {base.dtype}{tuple(base.shape)} on {base.device} vs "
                         f"{target.dtype}{tuple(target.shape)} on {target.device}")
    code, numel = code_of(base.dtype), base.numel()
    if not base.is_cuda:
        return _C.delta_encode_cpu(base.data_ptr(), target.data_ptr(), code, numel, _threads(threads))
    sms, dev = max_sms_in_force(max_sms), base.device.index
    stream = _device.stream(dev)
    with _on(dev):
        ws = torch.empty(_C.delta_workspace_bytes(numel), dtype=torch.uint8, device=base.device)
        sums = _sums(3, base.device)
        _C.delta_plan_gpu(base.data_ptr(), target.data_ptr(), code, numel, ws.data_ptr(), stream, sms, dev)
        _gpu_checksum(base.data_ptr(), base.nbytes, sums, 0, sms)
        _gpu_checksum(target.data_ptr(), target.nbytes, sums, 1, sms)
        nb = -(-numel >> _C.delta_block_log2)
        total, changed = ws[:8 * (nb + 2)].view(torch.int64)[nb:].tolist()  # waits for the plan's table
        out = torch.empty(total, dtype=torch.uint8, device=base.device)
        _C.delta_write_gpu(base.data_ptr(), target.data_ptr(), code, numel, out.data_ptr(), ws.data_ptr(), stream, sms,
                           dev)
        _gpu_checksum(out.data_ptr() + HEADER_BYTES, total - HEADER_BYTES, sums, 2, sms)
        s = sums.tolist()
        head = _C.delta_header(code, numel, changed, total, _finish(s, 0, base.nbytes), _finish(s, 1, target.nbytes),
                               _finish(s, 2, total - HEADER_BYTES) & _MASK32)
        out[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    return out


_HEADER_FIELDS = ("version", "dtype", "block_log2", "total_bytes", "numel", "changed", "base_checksum",
                  "target_checksum", "payload_bytes")


def _parse(stream: torch.Tensor) -> tuple:
    """The header's bytes and fields, checked against the stream's length (FormatError)."""
    head = stream[:HEADER_BYTES].cpu().numpy().tobytes()
    return head, dict(zip(_HEADER_FIELDS, _C.delta_parse_header(head, stream.numel())))


def inspect(stream: torch.Tensor) -> dict:
    """The stream's header fields (checked, without decoding): version, dtype,
    numel, changed elements, bytes, and the base and target checksums."""
    _check_stream(stream)
    _, info = _parse(stream)
    return {"version": info["version"], "dtype": dtype_of(info["dtype"]), "numel": info["numel"],
            "changed": info["changed"], "bytes": info["total_bytes"], "base_checksum": info["base_checksum"],
            "target_checksum": info["target_checksum"]}


def _raise(code: int) -> None:
    text = _C.delta_error_text(code)
    if code == _C.delta_error_base_mismatch:
        raise BaseMismatch(text)
    raise FormatError(text)


def apply(base: torch.Tensor, stream: torch.Tensor, *, threads: Optional[int] = None,
          max_sms: Optional[int] = None) -> None:
    """Rebuild the stream's target in place in base. Raises FormatError (a
    damaged or relabelled stream: base untouched), BaseMismatch (base is not
    the stream's base: untouched) or FormatError after the rebuild when the
    result fails its checksum (base holds no known version: full sync)."""
    _check_delta_tensor(base, "base")
    _check_stream(stream)
    if stream.device != base.device:
        stream = stream.to(base.device)
    code, numel = code_of(base.dtype), base.numel()
    if not base.is_cuda:
        err = _C.delta_apply_cpu(base.data_ptr(), code, numel, stream.data_ptr(), stream.numel(), _threads(threads))
        if err:
            _raise(err)
        return
    head, info = _parse(stream)
    if info["dtype"] != code or info["numel"] != numel:
        _raise(_C.delta_error_mismatch)
    sms, dev = max_sms_in_force(max_sms), base.device.index
    if stream.data_ptr() % 4:
        stream = stream.clone()  # the kernels read 32-bit words
    cuda_stream = _device.stream(dev)
    with _on(dev):
        ws = torch.empty(_C.delta_workspace_bytes(numel), dtype=torch.uint8, device=base.device)
        sums = _sums(4, base.device)  # three checksums, then the error word
        err = sums[6:7]
        total = info["total_bytes"]
        # Stream and base checked (table, body and base checksums, every block decoded dry) before a write.
        _C.delta_table_gpu(stream.data_ptr(), head, ws.data_ptr(), err.data_ptr(), cuda_stream, dev)
        _gpu_checksum(stream.data_ptr() + HEADER_BYTES, total - HEADER_BYTES, sums, 0, sms)
        _gpu_checksum(base.data_ptr(), base.nbytes, sums, 1, sms)
        _C.delta_decode_gpu(base.data_ptr(), stream.data_ptr(), head, ws.data_ptr(), err.data_ptr(), False,
                            cuda_stream, sms, dev)
        s = sums.tolist()
        e = _C.delta_gpu_verdict(head, s[6], _finish(s, 0, total - HEADER_BYTES) & _MASK32, _finish(s, 1, base.nbytes))
        if e:
            _raise(e)
        _C.delta_decode_gpu(base.data_ptr(), stream.data_ptr(), head, ws.data_ptr(), err.data_ptr(), True,
                            cuda_stream, sms, dev)
        _gpu_checksum(base.data_ptr(), base.nbytes, sums, 2, sms)
        s = sums.tolist()
        if _finish(s, 2, base.nbytes) != info["target_checksum"]:
            _raise(_C.delta_error_target_mismatch)
