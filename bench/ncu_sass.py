"""Summarizes an ncu report's SASS source page: the instructions with the
most warp-stall samples, with their stall reasons, and the totals by reason.

    ncu -i report.ncu-rep --page source --csv --print-source sass > src.csv
    python bench/ncu_sass.py src.csv [--top 60]
"""
import argparse
import csv
import sys


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=60)
    a = p.parse_args(argv)
    with open(a.csv, newline="") as f:
        table = list(csv.reader(f))
    # The page may start with report lines; the table starts at its header row.
    start = next((i for i, r in enumerate(table) if "Source" in r and any(c.startswith("Warp Stall Sampling") for c in r)), None)
    if start is None:
        print("no source table; first lines:", table[:5])
        return 1
    header = table[start]
    rows = [dict(zip(header, r)) for r in table[start + 1:] if len(r) == len(header)]
    if not rows:
        print("no rows")
        return 1
    samp = next(c for c in header if c.startswith("Warp Stall Sampling (All"))
    execd = next((c for c in header if c.startswith("Instructions Executed")), None)
    # Each reason also has a "(Not Issued)" column; the all-samples one is enough.
    reasons = [c for c in header if c.startswith("stall_") and not c.endswith("(Not Issued)")]
    num = lambda r, c: float((r.get(c) or "0").replace(",", "") or 0)
    total = sum(num(r, samp) for r in rows) or 1.0
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples")
    by_reason = {c: sum(num(r, c) for r in rows) for c in reasons}
    for c, v in sorted(by_reason.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {c}: {v:.0f} ({100 * v / total:.1f}%)")
    print(f"\n{'#':>5} {'samples':>8} {'%':>5} {'executed':>10}  source   top reasons")
    order = sorted(range(len(rows)), key=lambda i: -num(rows[i], samp))
    for i in order[: a.top]:
        r = rows[i]
        top = sorted(((num(r, c), c) for c in reasons), reverse=True)[:3]
        why = ", ".join(f"{c.replace('stall_', '')}={v:.0f}" for v, c in top if v)
        print(f"{i:5d} {num(r, samp):8.0f} {100 * num(r, samp) / total:5.1f} {num(r, execd) if execd else 0:10.0f}  {r['Source'][:70]:70s} {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
