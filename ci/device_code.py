#!/usr/bin/env python3
"""Lists the device code a portable_zip wheel (or an installed package's
device/ directory) carries, and fails if an expected arch is missing or a
file is not what its name says.

    python3 ci/device_code.py [--quick] WHEEL_OR_DIR

Checks, by reading the ELF headers and the bundle index directly:
  - each sm_XY.cubin is an NVIDIA ELF (EM_CUDA) for sm_XY;
  - compute_XY.ptx targets sm_XY;
  - amdgcn.hipfb is a clang offload bundle with one AMD ELF (EM_AMDGPU) per
    expected gfx target, of that target's machine type;
  - every file defines the same kernel entry points, the PTX's .entry list.
"""
import argparse
import io
import os
import re
import struct
import sys
import zipfile

CUDA_FULL = [80, 86, 89, 90, 100, 120]
HIP_FULL = ["gfx90a", "gfx942", "gfx1030", "gfx1100", "gfx1201",
            "gfx9-generic", "gfx10-3-generic", "gfx11-generic", "gfx12-generic"]
CUDA_QUICK = [90]  # one cubin and its PTX: the quick wheel checks packaging, not every arch
HIP_QUICK = ["gfx90a", "gfx11-generic"]  # wave64 and a generic wave32 target (CI time: a pass is ~100 s)
# EF_AMDGPU_MACH_* (LLVM's ELF.h).
AMD_MACH = {"gfx90a": 0x3F, "gfx942": 0x4C, "gfx1030": 0x36, "gfx1100": 0x41, "gfx1201": 0x4E,
            "gfx9-generic": 0x51, "gfx10-3-generic": 0x53, "gfx11-generic": 0x54, "gfx12-generic": 0x59}
EM_CUDA, EM_AMDGPU = 190, 224


def elf_header(b: bytes):
    if b[:4] != b"\x7fELF" or b[4] != 2:
        raise ValueError("not a 64-bit ELF")
    machine = struct.unpack_from("<H", b, 18)[0]
    flags = struct.unpack_from("<I", b, 48)[0]
    return machine, flags, b[8]  # EI_ABIVERSION


def cubin_sm(b: bytes) -> int:
    machine, flags, abi = elf_header(b)
    if machine != EM_CUDA:
        raise ValueError(f"ELF machine {machine}, not EM_CUDA")
    return (flags >> 8) & 0xFF if abi >= 8 else flags & 0xFF  # the newer ABI moved the SM field


def bundle_entries(b: bytes) -> dict:
    magic = b"__CLANG_OFFLOAD_BUNDLE__"
    if not b.startswith(magic):
        raise ValueError("not a clang offload bundle")
    n, at, out = struct.unpack_from("<Q", b, len(magic))[0], len(magic) + 8, {}
    for _ in range(n):
        off, size, idlen = struct.unpack_from("<QQQ", b, at)
        ident = b[at + 24: at + 24 + idlen].decode()
        out[ident] = b[off: off + size]
        at += 24 + idlen
    return out


def entries_in(b: bytes, names) -> list:
    return [n for n in names if n.encode() + b"\0" not in b]


def load(path: str) -> dict:
    if os.path.isdir(path):
        return {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}
    with zipfile.ZipFile(path) as z:
        return {os.path.basename(n): z.read(n) for n in z.namelist() if "/device/" in n and not n.endswith("/")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="expect ci/wheels --quick's archs")
    ap.add_argument("path")
    a = ap.parse_args()
    files = load(a.path)
    want_sm, want_gfx = (CUDA_QUICK, HIP_QUICK) if a.quick else (CUDA_FULL, HIP_FULL)
    bad, rows = [], []
    ptx = sorted(f for f in files if re.fullmatch(r"compute_\d+\.ptx", f))
    if not ptx:
        bad.append("no PTX")
        names = []
    else:
        text = files[ptx[-1]].decode(errors="replace")
        names = re.findall(r"\.entry\s+(\w+)", text)
        target = re.search(r"^\.target\s+sm_(\d+)", text, re.M)
        rows.append((ptx[-1], f"PTX for sm_{target.group(1) if target else '?'}", len(names), len(files[ptx[-1]])))
        if not names:
            bad.append(f"{ptx[-1]} has no kernel entry points")
    for sm in want_sm:
        f = f"sm_{sm}.cubin"
        if f not in files:
            bad.append(f"missing {f}")
            continue
        try:
            got = cubin_sm(files[f])
        except ValueError as e:
            bad.append(f"{f}: {e}")
            continue
        missing = entries_in(files[f], names)
        rows.append((f, f"NVIDIA ELF, sm_{got}", len(names) - len(missing), len(files[f])))
        if got != sm:
            bad.append(f"{f} is code for sm_{got}")
        if missing:
            bad.append(f"{f} lacks {len(missing)} kernels, e.g. {missing[0]}")
    if "amdgcn.hipfb" not in files:
        bad.append("missing amdgcn.hipfb")
    else:
        entries = bundle_entries(files["amdgcn.hipfb"])
        for gfx in want_gfx:
            obj = entries.get(f"hipv4-amdgcn-amd-amdhsa--{gfx}")
            if obj is None:
                bad.append(f"amdgcn.hipfb has no code object for {gfx} (it has {sorted(entries)})")
                continue
            machine, flags, _ = elf_header(obj)
            missing = entries_in(obj, names)
            rows.append((f"amdgcn.hipfb:{gfx}", f"AMD ELF, mach 0x{flags & 0xFF:x}", len(names) - len(missing), len(obj)))
            if machine != EM_AMDGPU or (flags & 0xFF) != AMD_MACH[gfx]:
                bad.append(f"{gfx}: machine {machine}, mach 0x{flags & 0xFF:x} (want {EM_AMDGPU}, 0x{AMD_MACH[gfx]:x})")
            if missing:
                bad.append(f"{gfx} lacks {len(missing)} kernels, e.g. {missing[0]}")
    print(f"device code in {a.path}:")
    for name, what, n, size in rows:
        print(f"  {name:34s} {what:22s} {n:3d} kernels {size / 2**20:7.2f} MiB")
    for b in bad:
        print("MISSING/WRONG:", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
