#!/usr/bin/env python3
"""Compiles the device module with NVRTC, NVIDIA's compiler as a library
(PyPI: nvidia-cuda-nvrtc-cu12), where no nvcc is installed:

    nvrtc_compile.py --nvrtc libnvrtc.so.12 --arch sm_90|compute_90 [--ptx PTX] [-D NAME=VALUE...] -I DIR... SRC -o OUT

sm_XY writes a cubin (and with --ptx, the same compile's PTX: that of
compute_XY), compute_XY PTX. NVRTC runs nvcc's own front end and
optimizer, so the code matches an nvcc build of the same CUDA version."""
import argparse
import ctypes
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvrtc", required=True)
    ap.add_argument("--arch", required=True)
    ap.add_argument("-I", dest="includes", action="append", default=[])
    ap.add_argument("-D", dest="defines", action="append", default=[])
    ap.add_argument("-o", dest="out", required=True)
    ap.add_argument("--ptx", help="with an sm_XY arch: also write the compile's PTX here")
    ap.add_argument("src")
    a = ap.parse_args()
    lib = ctypes.CDLL(a.nvrtc)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(rc, what):
        if rc:
            raise SystemExit(f"nvrtc: {what}: {lib.nvrtcGetErrorString(rc).decode()}")

    prog = ctypes.c_void_p()
    src = open(a.src, "rb").read()
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), src, a.src.encode(), 0, None, None), "creating the program")
    # -default-device: the headers' unannotated (host-side) helpers compile as device code, unused.
    opts = [f"-arch={a.arch}", "-std=c++17", "-DNDEBUG", "-default-device"]
    opts += [f"-D{d}" for d in a.defines] + [f"-I{d}" for d in a.includes]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.stderr.write(log.value.decode(errors="replace"))
        check(rc, f"compiling {a.src} for {a.arch}")
    cubin = a.arch.startswith("sm_")

    def output(get_size, get, path, text):
        check(get_size(prog, ctypes.byref(size)), "sizing the output")
        buf = ctypes.create_string_buffer(size.value)
        check(get(prog, buf), "reading the output")
        with open(path, "wb") as f:
            f.write(buf.raw.rstrip(b"\0") if text else buf.raw)

    if cubin:
        output(lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN, a.out, False)
    if not cubin or a.ptx:
        output(lib.nvrtcGetPTXSize, lib.nvrtcGetPTX, a.ptx if cubin else a.out, True)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return 0


if __name__ == "__main__":
    sys.exit(main())
