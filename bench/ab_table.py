"""Side-by-side table of a bench/ab_gpu.sh lease: for each row (system,
tensor, size), each tree's best compress / decompress time over the rounds
and its change in speed against the base tree (+: faster).

    python bench/ab_table.py OUT_DIR [--trees base,this,...]
"""
import argparse
import glob
import json
import os
import sys
from collections import defaultdict


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--trees", default="", help="column order (default: base, this, then the rest)")
    a = p.parse_args(argv)
    best = defaultdict(dict)  # row -> tree -> (compress_us, decompress_us)
    trees = []
    for f in sorted(glob.glob(os.path.join(a.out, "*-r*.json"))):
        tree = os.path.basename(f).rsplit("-r", 1)[0]
        if tree not in trees:
            trees.append(tree)
        for r in json.load(open(f))["rows"]:
            if "error" in r:
                print(f"{tree}: {r}")
                continue
            key = (r["system"], r["tensor"], r["bytes"], r.get("max_sms"))
            c, d = r["compress_us"], r["decompress_us"]
            old = best[key].get(tree)
            best[key][tree] = (min(c, old[0]), min(d, old[1])) if old else (c, d)
    order = [t for t in a.trees.split(",") if t] or sorted(trees, key=lambda t: (t != "base", t != "this", t))
    if not best:
        print("no rows")
        return 1
    print(f"{'row':44s}" + "".join(f"{t:>30s}" for t in order))
    for key, by in best.items():
        system, tensor, size, sms = key
        label = f"{system} {tensor} {size >> 20} MiB" + (f" {sms} SMs" if sms else "")
        base = by.get(order[0])
        cells = []
        for t in order:
            if t not in by:
                cells.append(f"{'-':>30s}")
                continue
            c, d = by[t]
            gain = "" if t == order[0] or not base else f" {100 * (base[0] / c - 1):+.0f}/{100 * (base[1] / d - 1):+.0f}%"
            cells.append(f"{c:7.1f} / {d:7.1f}{gain}".rjust(30))
        print(f"{label[:44]:44s}" + "".join(cells))
    print("(µs, best of the rounds, compress / decompress; % = compress / decompress speed against the first column)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
