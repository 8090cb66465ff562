"""Which GPU vendor this process uses, and its kernels.

The extension links no vendor runtime. On first GPU use it loads the one
torch runs on (CUDA's driver, or ROCm's HIP runtime) and the device code
shipped in ``portable_zip/device/``: one cubin per NVIDIA arch plus PTX, and
one AMD code-object bundle. A build without the vendor's code (a source
build on a machine with no GPU compiler) warns once and raises a clear error.
"""
import os
import warnings

import torch

import portable_zip._C as _C

CODE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "device")
_loaded = None  # the vendor whose runtime loaded

# torch's own entry points for the per-call lookups of the GPU path (a CUDA or
# ROCm build of torch has them); torch.cuda's wrappers build a Stream object
# or re-check initialization each time, microseconds a call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def stream(index: int) -> int:
    """The raw handle of torch's current stream on device index: where a
    call's kernels and copies queue."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def current() -> int:
    """The index of this thread's current device, as torch sees it."""
    return _get_device() if _get_device is not None else torch.cuda.current_device()


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return bool(_capturing()) if _capturing is not None else torch.cuda.is_current_stream_capturing()


def vendor() -> str:
    """The GPU vendor torch runs on here: "cuda", "hip", or "cpu"."""
    if getattr(torch.version, "hip", None):
        return "hip"
    if torch.version.cuda:
        return "cuda"
    return "cpu"


def code_files(v: str) -> list:
    return list(_C.gpu_code_files(v, CODE_DIR)) if v in ("cuda", "hip") else []


def archs(v: str) -> list:
    """The archs this build carries device code for: sm_XY and compute_XY
    files for NVIDIA, the bundle's gfx targets for AMD."""
    out = []
    for f in code_files(v):
        if v == "cuda":
            out.append(f.rsplit(".", 1)[0])
        else:
            with open(os.path.join(CODE_DIR, f), "rb") as fh:
                out += _C.bundle_targets(fh.read(1 << 16))
    return out


def has_code() -> bool:
    """True when this build carries device code for the vendor torch runs on."""
    return bool(code_files(vendor()))


def require() -> None:
    """Loads the vendor runtime and points it at the device code; raises a
    ValueError that says what is missing and how to get it."""
    global _loaded
    if _loaded is not None:
        return
    v = vendor()
    if v == "cpu":
        raise ValueError("GPU tensor, but this torch has neither CUDA nor ROCm")
    if not code_files(v):
        other = "hip" if v == "cuda" else "cuda"
        msg = (f"portable_zip was built without {'NVIDIA' if v == 'cuda' else 'AMD'} device code "
               f"(this build carries: {', '.join(code_files(other)) or 'CPU code only'}), so it cannot run "
               f"on this {v} GPU. Install the prebuilt wheel (pip install portable_zip), or build from source "
               f"with {'nvcc or PZ_CUDA_ROOT' if v == 'cuda' else 'hipcc or clang-19'} available "
               "(README: Install).")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        raise ValueError(msg)
    why = _C.gpu_load(v, CODE_DIR)
    if why:
        raise ValueError(f"portable_zip cannot use the GPU: {why}")
    _loaded = v
