"""python -m portable_zip {demo,inspect}"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m portable_zip",
                                epilog="Benchmarks live in a source checkout's bench/ folder "
                                       "(python -P bench/codec.py, bench/comm.py, ...).")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="time the codec on a model-shaped state dict and move it between two local processes")
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--hidden", type=int, default=1024)

    i = sub.add_parser("inspect", help="print the header of a stream saved with tensor.numpy().tofile()")
    i.add_argument("path")

    args = p.parse_args(argv)
    if args.cmd == "demo":
        from .demo import run

        return run(layers=args.layers, hidden=args.hidden)
    return _inspect(args.path)


def _inspect(path: str) -> int:
    import numpy as np
    import torch

    import portable_zip as pz

    buf = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
    for k, v in pz.inspect(buf).items():
        print(f"{k:>16}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
