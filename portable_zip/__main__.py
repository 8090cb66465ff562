"""python -m portable_zip {demo,inspect,build-gate}"""
from __future__ import annotations

import argparse
import sys

PROG = "python -m portable_zip"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG,
                                epilog="Benchmarks live in a source checkout's bench/ folder "
                                       "(python -P bench/codec.py, bench/comm.py, ...).")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,inspect,build-gate}")

    what = "time the codec on a model-shaped state dict and move it between two local processes"
    d = sub.add_parser("demo", help=what, description=what.capitalize() + ": 2 GPUs over NCCL where present, "
                       "else two hosts in network namespaces behind a shaped link (PZ_NETNS_GBIT Gbit/s, "
                       "default 1; needs root and iproute2), else loopback. Every result is checked bit for bit.")
    d.add_argument("--layers", type=int, default=4, metavar="N",
                   help="transformer layers of the bf16 state dict (default: %(default)s)")
    d.add_argument("--hidden", type=int, default=1024, metavar="D",
                   help="hidden size of the state dict; its vocabulary is 16,000 (default: %(default)s)")

    what = "print the header of a stream saved with tensor.numpy().tofile()"
    i = sub.add_parser("inspect", help=what, description=what.capitalize() + " (a pz.compress output).")
    i.add_argument("path", help="the file holding the stream")

    what = "build the pz backend's native gate for the installed torch"
    b = sub.add_parser("build-gate", help=what, description=what.capitalize() + " (a C++20 compiler, ~40 s): "
                       "native ops then cost what torch's own call costs. It lands in $PZ_GATE_DIR "
                       "(default ~/.cache/portable_zip/gate).")
    b.add_argument("-v", "--verbose", action="store_true", help="print the compiler's command")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "demo":
        from .demo import run

        return run(layers=args.layers, hidden=args.hidden)
    if args.cmd == "build-gate":
        return _build_gate(args.verbose)
    return _inspect(args.path)


def _build_gate(verbose: bool) -> int:
    from .c10d import native

    try:
        print(native.build(verbose))
    except RuntimeError as e:
        print(f"{PROG} build-gate: {e}", file=sys.stderr)
        return 1
    return 0


def _inspect(path: str) -> int:
    """The header's fields; a file that is not a stream: one line on stderr, exit 1."""
    import numpy as np
    import torch

    import portable_zip as pz

    try:
        buf = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        fields = pz.inspect(buf)
    except OSError as e:
        return _fail(f"{path}: {e.strerror or e}")
    except (pz.FormatError, ValueError) as e:
        what = str(e) if "not a portable_zip stream" in str(e) else f"not a portable_zip stream: {e}"
        return _fail(f"{path}: {what}")
    for k, v in fields.items():
        print(f"{k:>16}: {v}")
    return 0


def _fail(msg: str) -> int:
    print(f"{PROG} inspect: {msg}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
