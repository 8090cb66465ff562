"""The run-time GPU loader (kernels/device_api.cpp, portable_zip/_device.py):
which device code file serves which GPU, and the errors a machine without
the vendor's runtime or without the build's device code gets. Also what _C
tells GPU callers without a GPU: the stream size field's place, the launch report."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import portable_zip as pz
from portable_zip import _C
from portable_zip.codec import device as _device

GOLDEN = Path(__file__).parent / "golden"
FILES = ["compute_90.ptx", "sm_100.cubin", "sm_120.cubin", "sm_80.cubin", "sm_86.cubin", "sm_89.cubin", "sm_90.cubin"]


@pytest.mark.parametrize("cc, want", [
    ((8, 0), "sm_80.cubin"), ((8, 6), "sm_86.cubin"), ((8, 7), "sm_86.cubin"),  # same major, highest minor not above
    ((8, 9), "sm_89.cubin"), ((9, 0), "sm_90.cubin"), ((10, 0), "sm_100.cubin"), ((10, 3), "sm_100.cubin"),
    ((12, 0), "sm_120.cubin"), ((12, 1), "sm_120.cubin"),
    ((11, 0), "compute_90.ptx"),  # no cubin of that major: the driver compiles the PTX
    ((7, 5), ""),                 # older than every file: nothing runs there
])
def test_cuda_image_choice(cc, want):
    assert _C.pick_cuda_image(FILES, *cc) == want


def test_cuda_image_choice_without_ptx():
    files = [f for f in FILES if not f.endswith(".ptx")]
    assert _C.pick_cuda_image(files, 11, 0) == ""
    assert _C.pick_cuda_image(["compute_80.ptx", "compute_90.ptx"], 8, 9) == "compute_80.ptx"


def test_code_files_by_vendor(tmp_path):
    for f in FILES + ["amdgcn.hipfb", "notes.txt", "sm_90.cubin.bak"]:
        (tmp_path / f).write_bytes(b"x")
    assert _C.gpu_code_files("cuda", str(tmp_path)) == sorted(FILES)
    assert _C.gpu_code_files("hip", str(tmp_path)) == ["amdgcn.hipfb"]
    assert _C.gpu_code_files("cuda", str(tmp_path / "missing")) == []
    with pytest.raises(ValueError, match="unknown GPU vendor"):
        _C.gpu_code_files("metal", str(tmp_path))


def _load_in_child(vendor: str, env: dict) -> str:
    """gpu_load in a fresh process (a loaded runtime stays loaded)."""
    code = f"from portable_zip import _C; print(_C.gpu_load({vendor!r}, '/nonexistent'))"
    res = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_missing_hip_runtime_says_what_is_missing():
    why = _load_in_child("hip", {"PZ_GPU_LIBRARY": "/nonexistent/libamdhip64.so.7"})
    assert "HIP runtime" in why and "libamdhip64" in why and "ROCm" in why, why


@pytest.mark.skipif(torch.cuda.is_available(), reason="the NVIDIA driver is present")
def test_missing_nvidia_driver_says_what_is_missing():
    why = _load_in_child("cuda", {"PZ_GPU_LIBRARY": "/nonexistent/libcuda.so.1"})
    assert "libcuda.so.1" in why and "NVIDIA driver" in why, why


def test_hip_runtime_without_a_gpu_is_a_clear_error():
    """Debian's libamdhip64.so.5 (installed for the compile matrix) loads but finds no GPU here."""
    why = _load_in_child("hip", {})
    if torch.cuda.is_available() and torch.version.hip:
        assert why == ""
    else:
        assert why and ("did not initialize" in why or "could not be loaded" in why), why


def test_build_without_the_vendors_code_warns_and_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(_device, "CODE_DIR", str(tmp_path))
    monkeypatch.setattr(_device, "vendor", lambda: "cuda")
    monkeypatch.setattr(_device, "_loaded", None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="built without NVIDIA device code"):
            _device.require()
    assert any(issubclass(x.category, RuntimeWarning) for x in w)


def test_installed_device_code_matches_the_build():
    """PZ_EXPECT_DEVICE_CODE=cuda,hip (ci/test, for the wheel) says which vendors' code must be installed."""
    want = [v for v in os.environ.get("PZ_EXPECT_DEVICE_CODE", "").split(",") if v]
    info = pz.backend_info()["device_code"]
    for v in want:
        assert info[v], f"the installed package has no {v} device code: {info}"
    if "cuda" in want:
        assert any(a.startswith("sm_") for a in info["cuda"]) and any(a.startswith("compute_") for a in info["cuda"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None or not _device.has_code(),
                    reason="needs an NVIDIA GPU and a build with its code")
def test_the_loader_picks_the_cubin_for_this_gpu():
    t = torch.randn(1 << 16, device="cuda").to(torch.bfloat16)
    assert torch.equal(pz.decompress(pz.compress(t)), t)
    major, minor = torch.cuda.get_device_capability()
    info = pz.backend_info()
    assert info["device_image"] == _C.pick_cuda_image(_device.code_files("cuda"), major, minor), info


def test_bundle_targets_from_the_index():
    import struct

    ids = [b"host-x86_64-unknown-linux-gnu-", b"hipv4-amdgcn-amd-amdhsa--gfx942", b"hipv4-amdgcn-amd-amdhsa--gfx11-generic"]
    head = b"__CLANG_OFFLOAD_BUNDLE__" + struct.pack("<Q", len(ids))
    head += b"".join(struct.pack("<QQQ", 0, 0, len(i)) + i for i in ids)
    assert _C.bundle_targets(head) == ["gfx942", "gfx11-generic"]
    assert _C.bundle_targets(head[:-5]) == ["gfx942"]  # a cut index ends the list
    assert _C.bundle_targets(b"not a bundle") == []
    huge = b"__CLANG_OFFLOAD_BUNDLE__" + struct.pack("<Q", 1) + struct.pack("<QQQ", 0, 0, 2**64 - 8)
    assert _C.bundle_targets(huge) == []


def test_total_bytes_offset_reads_every_streams_size():
    """_C.total_bytes_offset: where a stream's size field lies (what a reader
    of a GPU stream's size slices), the same value parse_header reports, on
    the golden streams of every format version; no stream is shorter than
    _C.fixed_header_bytes, which parse_header requires."""
    off, fixed = _C.total_bytes_offset, _C.fixed_header_bytes
    streams = sorted(GOLDEN.glob("*.pz")) + sorted(GOLDEN.glob("v*/*.pz"))
    assert len(streams) > 10
    for path in streams:
        data = path.read_bytes()
        assert off + 8 <= fixed <= len(data), path
        size = int.from_bytes(data[off: off + 8], "little")
        assert size == _C.parse_header(data, len(data))["total_bytes"] == len(data), path
    with pytest.raises(pz.FormatError, match="shorter than the fixed 32-byte header"):
        _C.parse_header(data[: fixed - 1], len(data))


def test_launch_report_counts_no_cpu_work():
    """_C.launch_report counts GPU codec launches only (tests/test_gpu.py
    checks them): CPU compress and decompress leave it at zero; reset=True
    reads then zeroes it, a plain read leaves it."""
    _C.launch_report(reset=True)
    zero = {"launches": 0, "max_grid": 0, "max_sms": 0, "max_grid_sms": 0}
    t = torch.randn(300_001).to(torch.bfloat16)
    assert torch.equal(pz.decompress(pz.compress(t)).view(torch.int16), t.view(torch.int16))
    assert _C.launch_report() == zero
    assert _C.launch_report(reset=True) == zero and _C.launch_report() == zero
