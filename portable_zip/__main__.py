"""python -m portable_zip {demo,bench,inspect}"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m portable_zip")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="compress a model-shaped state dict and move it between two local processes")
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--hidden", type=int, default=1024)

    b = sub.add_parser("bench", help="benchmarks")
    b.add_argument("--codec", action="store_true", help="codec ratio and throughput")
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    b.add_argument("--size", default=None, help="tensor sizes, comma-separated (default: 1MiB..1GiB on GPU, 64MiB on CPU)")
    b.add_argument("--systems", default="ours,ours-fixed,nvcomp,dietgpu", help="GPU: systems measured side by side")
    b.add_argument("--max-sms", default="", help="GPU: also measure ours under these SM budgets, e.g. 33,66")
    b.add_argument("--png", default=None, help="GPU: write the throughput-vs-size plot here")
    b.add_argument("--reps", type=int, default=None)
    b.add_argument("--json", default=None, help="write results to this JSON file")

    i = sub.add_parser("inspect", help="print the header of a stream saved with tensor.numpy().tofile()")
    i.add_argument("path")

    args = p.parse_args(argv)
    if args.cmd == "demo":
        from .bench.demo import run

        return run(layers=args.layers, hidden=args.hidden)
    if args.cmd == "bench":
        if not args.codec:
            p.error("bench needs --codec")
        return _bench_codec(args)
    return _inspect(args.path)


def _bench_codec(args) -> int:
    import numpy as np
    import torch

    from .bench.common import codec_rows, parse_size, print_table, write_json

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":  # ours vs nvCOMP vs DietGPU, side by side (bench/codec.py)
        from .bench import codec as codec_bench

        argv = ["--systems", args.systems, "--sizes", args.size or codec_bench.DEFAULT_SIZES,
                "--reps", str(args.reps or 20), "--max-sms", args.max_sms]
        argv += ["--json", args.json] if args.json else []
        argv += ["--png", args.png] if args.png else []
        return codec_bench.main(argv)
    reps = args.reps or 3
    rows = [r for size in (args.size or "64MiB").split(",") for r in codec_rows(device, parse_size(size), reps)]
    cols = ["tensor", "bytes", "ratio", "bound", "bar", "est_local_tables", "est_global_table", "compress_GBps",
            "decompress_GBps", "compress_us", "decompress_us"]
    print_table(rows, cols, f"portable_zip codec on {device}, {torch.get_num_threads()} threads "
                "(ratio = compressed/original; GB/s of input bytes)")
    from .bench import cpu_refs
    from .bench.data import make_tensor

    rng = np.random.default_rng(0)
    size = parse_size((args.size or "64MiB").split(",")[0])
    refs = cpu_refs.rows([(n, make_tensor(n, size, rng, "cpu")) for n in ("bf16 N(0,0.02^2)", "bf16 U[-1,1]")], reps)
    print_table(refs, ["tensor", "bytes", "system", "ratio", "round_trip", "compress_GBps", "decompress_GBps", "error"],
                "CPU codecs side by side (GB/s of input bytes; a failed round trip reports no speed)")
    if args.json:
        write_json(args.json, rows + refs)
    bad = [r["tensor"] for r in rows if r["ratio"] > r["bar"] and r["bytes"] >= 64 << 20]
    if bad:
        print(f"ratio bar missed: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


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
