"""Codec throughput side by side: ours vs nvCOMP ANS vs DietGPU's float codec,
on the same tensors in one run, plus ours on every dtype and under SM budgets.
On the CPU (--device cpu, the default without a GPU): ours on every dtype,
its ratio beside the entropy bound and the ratio bar, then ours beside zstd -1
and ZipNN.

    python -P bench/codec.py [--sizes 1MiB,...,1GiB] [--max-sms 33,66] [--json out.json] [--png out.png]
    python -P bench/codec.py --device cpu [--sizes 64MiB] [--json out.json]

GPU: each system is measured in its own child process (a reference that faults
cannot take the others down); the parent merges the rows, prints the table,
writes the JSON and the plot. Throughput is GB/s of input bytes: the median
of the timed reps, each timed with device events around one call, inputs
rotated across more than 3x L2. A busy-wait kernel is queued before each rep
so host-side call overhead is not counted as device time. nvCOMP comes from
the nvidia-nvcomp-cu13 wheels, DietGPU from bench/ref/build_dietgpu.sh
(PZ_DIETGPU_LIB points at its libdietgpu.so); a reference that is missing is
reported as an error row, not a failure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import List, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench.common import bench_tensor, codec_rows, fmt_size, machine_info, median_time, parse_size, print_table, write_json  # noqa: E402
from pzbench import real_weights  # noqa: E402
from pzbench.refs import LABELS, SYSTEMS  # noqa: E402
from harness.tensors import TENSORS, exponent_entropy_bound  # noqa: E402

DEFAULT_SIZES = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB"
HEAD_TO_HEAD = "bf16 N(0,0.02^2)"
ALL_TENSORS = list(TENSORS) + list(real_weights.REAL)


def default_tensors() -> str:
    """The head-to-head tensors: two synthetic, and the real weight sets where they are prepared."""
    gone = real_weights.missing()
    if gone:
        print(f"real weights left out: {gone}", file=sys.stderr)
        return f"{HEAD_TO_HEAD};bf16 U[-1,1]"
    return ";".join([HEAD_TO_HEAD, "bf16 U[-1,1]", *real_weights.REAL])


def device_median(fn, reps: int, sleep_cycles: int = 2_000_000) -> float:
    """Median seconds of fn(rep) on the GPU; the default sleep is ~1 ms of GPU time."""
    return median_time(fn, "cuda", reps, sleep_cycles=sleep_cycles)


def gpu_tensor(name: str, nbytes: int, gen: torch.Generator, copy: int = 0) -> torch.Tensor:
    """data.make_tensor's distributions, drawn on the GPU (seconds instead of minutes at 1 GiB),
    or a real weight set tiled (copies start at different elements)."""
    if name in real_weights.REAL:
        return real_weights.tiled(name, nbytes, "cuda", copy)
    dtype, dist, _ = TENSORS[name]
    n = nbytes // torch.empty(0, dtype=dtype).element_size()
    if dist == "uniform":
        v = torch.rand(n, generator=gen, device="cuda", dtype=torch.float32).mul_(2).sub_(1)
    else:
        v = torch.randn(n, generator=gen, device="cuda", dtype=torch.float32)
        if dist == "normal0.02":
            v.mul_(0.02)
    return v.to(dtype)


def measure(system: str, tensors: List[str], sizes: List[int], reps: int, seed: int,
            max_sms: Optional[List[int]] = None) -> list:
    rows = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for name in tensors:
        for nbytes in sizes:
            gen = torch.Generator(device="cuda").manual_seed(seed * 1_000_003 + nbytes + ALL_TENSORS.index(name))
            copies = max(1, -(-3 * l2 // nbytes))
            try:  # a set that cannot be built costs its own rows only
                inputs = [gpu_tensor(name, nbytes, gen, i) for i in range(copies)]
            except Exception as e:  # noqa: BLE001
                row = {"system": system, "label": LABELS[system], "tensor": name, "bytes": nbytes,
                       "error": f"building the input: {type(e).__name__}: {e}"[:300]}
                print(json.dumps(row), flush=True)
                rows.append(row)
                continue
            budgets = max_sms if (system == "ours" and max_sms) else [None]
            for sms in budgets:
                prep = None
                row = {"system": system, "label": LABELS[system], "tensor": name, "bytes": nbytes,
                       "max_sms": sms, "reps": reps}
                try:
                    prep = SYSTEMS[system](inputs, max_sms=sms) if system.startswith("ours") else SYSTEMS[system](inputs)
                    comp, decomp, size = prep
                    if system == "ours-batch":  # 64 tensors of nbytes each per call; host work is larger
                        tc = device_median(comp, reps, sleep_cycles=20_000_000)
                        td = device_median(decomp, reps, sleep_cycles=20_000_000)
                        row.update(ratio=size / nbytes, tensors=64, compress_GBps=64 * nbytes / tc / 1e9,
                                   compress_us=tc * 1e6, decompress_GBps=64 * nbytes / td / 1e9,
                                   decompress_us=td * 1e6)
                    else:
                        tc, td = device_median(comp, reps), device_median(decomp, reps)
                        row.update(ratio=size / nbytes, compress_GBps=nbytes / tc / 1e9,
                                   decompress_GBps=nbytes / td / 1e9, compress_us=tc * 1e6, decompress_us=td * 1e6)
                    if sms is None:
                        # i.i.d. synthetic tensors: a slice suffices; a real set's statistics vary along it
                        flat = inputs[0].reshape(-1)
                        row["bound"] = exponent_entropy_bound(flat if name in real_weights.REAL else flat[: 1 << 24])
                except Exception as e:  # a reference that is missing or fails is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"{system} {name} {fmt_size(nbytes)}: {row['error']}", file=sys.stderr, flush=True)
                rows.append(row)
                print(json.dumps(row), flush=True)
                del prep
            del inputs
            torch.cuda.empty_cache()
    return rows


def _child(system: str, tensors: str, sizes: str, reps: int, seed: int, max_sms: str = "") -> list:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, "-P", os.path.abspath(__file__), "--worker", system, "--out", path,
           "--sizes", sizes, "--tensors", tensors, "--reps", str(reps), "--seed", str(seed), "--max-sms", max_sms]
    rc = subprocess.run(cmd).returncode
    rows = json.load(open(path)) if os.path.getsize(path) else []
    os.unlink(path)
    if rc != 0:
        rows.append({"system": system, "label": LABELS[system], "error": f"worker exited with {rc}"})
    return rows


def plot(rows: list, path: str) -> None:
    """Compress and decompress GB/s against size: a row of panels per head-to-head tensor measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [t for t in [HEAD_TO_HEAD, *real_weights.REAL] if any(r.get("tensor") == t and "error" not in r for r in rows)]
    if not shown:
        return
    fig, axes = plt.subplots(len(shown), 2, figsize=(12, 4.5 * len(shown)), sharey=True, squeeze=False)
    for row, tensor in zip(axes, shown):
        for ax, key, title in ((row[0], "compress_GBps", "compress"), (row[1], "decompress_GBps", "decompress")):
            for system in (s for s in SYSTEMS if s != "ours-batch"):
                pts = sorted((r["bytes"], r[key]) for r in rows if r.get("system") == system
                             and r.get("tensor") == tensor and r.get("max_sms") is None and key in r)
                if pts:
                    ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], marker="o", label=LABELS[system])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("input size (MiB)")
            ax.set_title(f"{title}, {tensor}")
            ax.grid(True, which="both", alpha=0.3)
        row[0].set_ylabel("GB/s of input bytes")
        row[0].legend()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "GPU"
    fig.suptitle(f"GPU codec throughput on one {gpu} (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cpu_main(a) -> int:
    """Ours on every dtype on the CPU, then the CPU references on the first size;
    fails if a tensor of 64 MiB or more misses its ratio bar."""
    real = [t for t in a.tensors.split(";") if t in real_weights.REAL]
    rows = [r for size in a.sizes.split(",")
            for r in codec_rows("cpu", parse_size(size), a.reps, names=list(TENSORS) + real, seed=a.seed)]
    cols = ["tensor", "bytes", "ratio", "bound", "bar", "est_local_tables", "est_global_table", "compress_GBps",
            "decompress_GBps", "compress_us", "decompress_us"]
    print_table(rows, cols, f"portable_zip codec on cpu, {torch.get_num_threads()} threads "
                "(ratio = compressed/original; GB/s of input bytes)")
    from pzbench import cpu_refs

    rng = np.random.default_rng(a.seed)
    size = parse_size(a.sizes.split(",")[0])
    refs = cpu_refs.rows([(n, bench_tensor(n, size, rng, "cpu")) for n in ("bf16 N(0,0.02^2)", "bf16 U[-1,1]", *real)],
                         a.reps)
    print_table(refs, ["tensor", "bytes", "system", "ratio", "round_trip", "compress_GBps", "decompress_GBps", "error"],
                "CPU codecs side by side (GB/s of input bytes; a failed round trip reports no speed)")
    if a.json:
        write_json(a.json, rows + refs)
    # Synthetic tensors only: a real set's order-0 bound may sit above 0.670 (CREPE's does), so its rows are reported.
    bad = [r["tensor"] for r in rows if r["tensor"] in TENSORS and r["ratio"] > r["bar"] and r["bytes"] >= 64 << 20]
    if bad:
        print(f"ratio bar missed: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if there is a GPU")
    p.add_argument("--systems", default="ours,ours-api,ours-fixed,nvcomp,dietgpu")
    p.add_argument("--sizes", default=None, help=f"default: {DEFAULT_SIZES} on the GPU, 64MiB on the CPU")
    p.add_argument("--tensors", default=None, help="tensors every system runs at every size, ;-separated (default: "
                   f"{HEAD_TO_HEAD};bf16 U[-1,1] and the real weight sets of bench/pzbench/real_weights.py)")
    p.add_argument("--dtype-size", default="256MiB", help="ours runs the other dtypes at this size ('' to skip)")
    p.add_argument("--max-sms", default="", help="ours on the first tensor under these SM budgets, e.g. 33,66,132")
    p.add_argument("--budget-size", default="256MiB,1GiB")
    p.add_argument("--batch-size", default="1MiB", help="compress_batch of 64 tensors of this size ('' to skip)")
    p.add_argument("--reps", type=int, default=None, help="default: 20 on the GPU, 3 on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.tensors = a.tensors or default_tensors()
    if a.device == "cpu":
        a.sizes, a.reps = a.sizes or "64MiB", a.reps or 3
        return cpu_main(a)
    if not torch.cuda.is_available():
        print("--device cuda: torch sees no GPU", file=sys.stderr)
        return 2
    a.sizes, a.reps = a.sizes or DEFAULT_SIZES, a.reps or 20
    if a.worker:
        sizes = [parse_size(s) for s in a.sizes.split(",")]
        sms = [int(x) for x in a.max_sms.split(",") if x] or None
        rows = measure(a.worker, a.tensors.split(";"), sizes, a.reps, a.seed, sms)
        json.dump(rows, open(a.out, "w"))
        return 0
    systems = a.systems.split(",")
    # The variants of ours (public-API timing, the fixed code) on the first tensor only: device time.
    jobs = [(s, a.tensors if s in ("ours", "nvcomp", "dietgpu") else a.tensors.split(";")[0], a.sizes, "")
            for s in systems]
    others = ";".join(t for t in TENSORS if t not in a.tensors.split(";"))
    if "ours" in systems and a.dtype_size and others:
        jobs.append(("ours", others, a.dtype_size, ""))
    if "ours" in systems and a.batch_size:
        jobs.append(("ours-batch", a.tensors.split(";")[0], a.batch_size, ""))
    if "ours" in systems and a.max_sms:
        jobs.append(("ours", a.tensors.split(";")[0], a.budget_size, a.max_sms))
    rows = [r for job in jobs for r in _child(*job[:3], a.reps, a.seed, job[3])]
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        r.setdefault("decompress_GBps", float("nan"))
        r.setdefault("decompress_us", float("nan"))
    print_table(ok, ["label", "tensor", "bytes", "max_sms", "ratio", "compress_GBps", "decompress_GBps",
                     "compress_us", "decompress_us"],
                "codec throughput (GB/s of input bytes; ratio = compressed/original)")
    for r in rows:
        if "error" in r:
            print(f"ERROR {r.get('label')} {r.get('tensor', '')} {r.get('bytes', '')}: {r['error']}")
    doc = {"machine": machine_info(), "method": __doc__, "rows": rows}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
    if a.png:
        plot(rows, a.png)
    return 0 if any(r["system"] == "ours" for r in ok) else 1


if __name__ == "__main__":
    sys.exit(main())
