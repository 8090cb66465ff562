"""The native gate (gate.cpp): built once against the installed torch, since
it is a c10d Backend and so tied to torch's C++ ABI, which the wheel is not.

    python -m portable_zip build-gate     # once per torch install (~40 s)

The build lands in $PZ_GATE_DIR (default ~/.cache/portable_zip/gate), named
for the torch, Python and source it was built from. A pz group uses it when
it is there (PZ_NATIVE_GATE=0: never); without it, native ops take the
Python thin path (thin.py), which costs more host time per op.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from typing import Optional

import torch

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gate.cpp")
_NAME = "pz_gate"
_loaded = None  # the module, or the reason there is none (str)


def _tag() -> str:
    with open(_SRC, "rb") as f:
        src = hashlib.sha256(f.read()).hexdigest()[:12]
    return f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{src}".replace("+", "_")


def path() -> str:
    """Where this torch's build of the gate is (or would be)."""
    root = os.environ.get("PZ_GATE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "portable_zip", "gate")
    return os.path.join(root, _tag(), _NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def _flags() -> list:
    from torch.utils import cpp_extension as ce
    abi = getattr(ce, "_get_pybind11_abi_build_flags", lambda: [])()
    glibcxx = getattr(ce, "_get_glibcxx_abi_build_flags", None)
    abi += glibcxx() if glibcxx else [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    libs = ce.library_paths()
    return (["-O2", "-shared", "-fPIC", "-std=c++20", "-w", f"-DTORCH_EXTENSION_NAME={_NAME}",
             "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{sysconfig.get_paths()['include']}"]
            + [f"-I{p}" for p in ce.include_paths()] + abi + [f"-L{p}" for p in libs]
            + [f"-Wl,-rpath,{p}" for p in libs] + ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"])


def build(verbose: bool = False) -> str:
    """Compile the gate for this torch (a C++20 compiler: $CXX, else c++);
    returns its path. Raises RuntimeError with the compiler's output."""
    out = path()
    if os.path.exists(out):
        return out
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler ($CXX, c++, g++) to build the pz native gate")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    cmd = [cxx, _SRC, "-o", tmp] + _flags()
    if verbose:
        print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building the pz native gate failed ({cxx}):\n{r.stderr[-4000:]}")
    os.replace(tmp, out)  # atomic: ranks building at once each land a whole file
    return out


def load():
    """The gate module, or None (why: reason())."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return None if isinstance(_loaded, str) else _loaded


def reason() -> str:
    """What the backend uses for native ops, in words (pz.backend_info())."""
    m = load()
    return f"native gate ({path()})" if m is not None else f"Python thin path: {_loaded}"


def _load():
    if os.environ.get("PZ_NATIVE_GATE", "1") == "0":
        return "PZ_NATIVE_GATE=0"
    p = path()
    if not os.path.exists(p):
        return "the native gate is not built for this torch (python -m portable_zip build-gate)"
    try:
        spec = importlib.util.spec_from_file_location(_NAME, p)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        return m
    except (ImportError, OSError) as e:
        return f"the native gate at {p} does not load: {e}"
