"""Killed-peer runs over the fabric transport, counted: a peer SIGKILLed
before or during a 256 MiB all_reduce or send/recv (2 CPU ranks,
tcp;ofi_rxm on loopback, raw and compressed), and what the survivor did:
raised PeerError / PeerTimeout, crashed (a signal), hung, or finished
before the kill landed. Some runs use an AddressSanitizer build of the
extension (--asan-dir: where it is installed, e.g.
  PZ_BACKEND=cpu pip install --no-build-isolation --no-deps --target DIR \\
    -C build-dir=BUILD -C cmake.define.CMAKE_CXX_FLAGS=-fsanitize=address \\
    -C cmake.define.CMAKE_SHARED_LINKER_FLAGS=-fsanitize=address .
run with libasan preloaded). The runs themselves are tests/test_fabric_kills.py's.

  python3 -P bench/fabric_crash_loop.py --runs 200 --asan-runs 24 --asan-dir DIR
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from test_fabric_kills import TCP, Runner  # noqa: E402

OPS = ("all_reduce", "send", "recv")  # what the survivor does (its peer the other side)
MODES = ("never", "always")           # raw, compressed
WHENS = ("before", "end", "mid")       # the kill: before traffic, around one op's end, mid-traffic


def plan(n: int, rng: random.Random, op_s: dict, only: tuple = (), whens: tuple = WHENS) -> list:
    """n jobs: a tenth killed before any fabric traffic, three tenths around
    the end of one op (0.7-1.6 of its measured duration, op_s: as the survivor
    finishes, closes its Communicator, or has closed it), the rest while the
    op repeats (a kill mid-traffic on any host)."""
    jobs = []
    pairs = [(op, mode) for mode in MODES for op in OPS if not only or f"{op}:{mode}" in only]
    kinds = [w for w in ["before"] + ["end"] * 3 + ["mid"] * 6 if w in whens]
    for i in range(n):
        op, mode = pairs[i % len(pairs)]
        when = kinds[(i // len(pairs)) % len(kinds)]
        if when == "before":
            jobs.append((op, mode, "before", 0.0))
        elif when == "end":
            jobs.append((op, mode, "end", round(rng.uniform(0.7, 1.6) * op_s[op, mode], 3)))
        else:
            jobs.append((op, mode, "mid", round(rng.uniform(0.02, 0.8 * op_s[op, mode]), 3)))
    rng.shuffle(jobs)
    return jobs


def durations(runner: Runner) -> dict:
    """How long each op takes unkilled here (the kill comes after the op)."""
    out = {}
    for op in OPS:
        for mode in MODES:
            r = runner.run(op, mode, "mid", 600.0, timeout=60.0, reps=1)
            if r["outcome"] != "completed":
                raise RuntimeError(f"an unkilled {op} {mode} did not complete: {r}")
            out[op, mode] = r["elapsed"]
    return out


def libfabric_version() -> str:
    """fi_version() of the library the ranks load, read in a child (this process keeps libfabric out)."""
    code = ("import ctypes, os; v = ctypes.CDLL(os.environ.get('PZ_FABRIC_LIBRARY') or 'libfabric.so.1').fi_version();"
            "print(f'{v >> 16}.{v & 0xFFFF}')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "IPATH_NO_BACKTRACE": "1"})
    return r.stdout.strip() or f"unknown ({r.stderr.strip()[-200:]})"


def loop(runner: Runner, jobs: list, label: str, results: list) -> None:
    for k, (op, mode, when, delay) in enumerate(jobs):
        r = runner.run(op, mode, when, delay, timeout=ARGS.timeout, cores=ARGS.cores)
        r["build"] = label
        results.append(r)
        print(f"{label} {k + 1}/{len(jobs)} {op} {mode} {when} {delay:.3f}: {r['outcome']} "
              f"{r.get('kind', r.get('signal', ''))} {r.get('elapsed', 0):.2f}s", flush=True)


def summary(results: list) -> dict:
    out = {}
    for label in sorted({r["build"] for r in results}):
        rs = [r for r in results if r["build"] == label]
        raised = [r for r in rs if r["outcome"] == "raised"]
        out[label] = {
            "runs": len(rs),
            "outcomes": dict(collections.Counter(r["outcome"] for r in rs)),
            "raised_kinds": dict(collections.Counter(r["kind"] for r in raised)),
            "by_scenario": {f"{op} {mode} {when}": dict(collections.Counter(
                r["outcome"] for r in rs if (r["op"], r["mode"], r["when"]) == (op, mode, when)))
                for op in OPS for mode in MODES for when in WHENS},
            "raise_s": {"min": min((r["elapsed"] for r in raised), default=None),
                        "median": sorted(r["elapsed"] for r in raised)[len(raised) // 2] if raised else None,
                        "max": max((r["elapsed"] for r in raised), default=None)},
        }
    return out


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200, help="runs with the installed build")
    ap.add_argument("--asan-runs", type=int, default=0, help="runs with the ASan build in --asan-dir")
    ap.add_argument("--asan-dir", default="", help="a --target install of an ASan build of portable_zip")
    ap.add_argument("--mib", type=int, default=256, help="bytes each op moves, MiB")
    ap.add_argument("--timeout", type=float, default=3.0, help="the Communicator's timeout, s")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--cores", action="store_true", help="dump a crashed survivor's core and keep gdb's backtrace")
    ap.add_argument("--only", default="", help="op:mode pairs to run, comma-separated (e.g. recv:never); all if empty")
    ap.add_argument("--when", default=",".join(WHENS), help="kill times to run, comma-separated (before,end,mid)")
    ap.add_argument("--out", default="", help="write the record here (JSON)")
    ARGS = ap.parse_args()
    seed = ARGS.seed if ARGS.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    results, t0 = [], time.time()
    runner = Runner(mib=ARGS.mib)
    op_s = durations(runner)
    print("unkilled op seconds:", {f"{k[0]} {k[1]}": round(v, 3) for k, v in op_s.items()}, flush=True)
    meta = {"seed": seed, "op_s": op_s, "t0": t0, "libfabric": libfabric_version()}
    only, whens = tuple(filter(None, ARGS.only.split(","))), tuple(ARGS.when.split(","))
    loop(runner, plan(ARGS.runs, rng, op_s, only, whens), "release", results)
    runner.close()
    save(results, meta)  # the release runs' record stands even if the ASan phase fails
    if ARGS.asan_runs:
        libasan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True,
                                 check=True).stdout.strip()
        env = {"LD_PRELOAD": libasan, "ASAN_OPTIONS": "detect_leaks=0:handle_segv=1:abort_on_error=1",
               "PYTHONPATH": os.path.abspath(ARGS.asan_dir)}
        runner = Runner(mib=ARGS.mib, env=env)
        loop(runner, plan(ARGS.asan_runs, rng, {k: v * 1.5 for k, v in op_s.items()}, only, whens), "asan", results)
        runner.close()
        save(results, meta)


def _commit() -> str:
    """The source tree's commit (the installed build should be of it), "+dirty" with local changes."""
    here = os.path.dirname(os.path.abspath(__file__))
    run = lambda *a: subprocess.run(["git", "-C", here, *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return run("rev-parse", "--short", "HEAD") + ("+dirty" if run("status", "--porcelain", "--untracked-files=no") else "")


def save(results: list, meta: dict) -> None:
    record = {
        "what": "a peer SIGKILLed before or during a fabric op (2 CPU ranks on loopback); the survivor's outcome",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "kernel": platform.release()},
        "libfabric": meta["libfabric"], "provider": TCP["PZ_FABRIC_PROVIDER"],
        "command": "python3 -P bench/fabric_crash_loop.py " + " ".join(sys.argv[1:]), "seed": meta["seed"], "mib": ARGS.mib,
        "timeout_s": ARGS.timeout,
        "unkilled_op_s": {f"{k[0]} {k[1]}": round(v, 3) for k, v in meta["op_s"].items()},
        "wall_s": round(time.time() - meta["t0"], 1),
        "summary": summary(results),
        "survivor_raise_s": {label: [round(r["elapsed"], 3) for r in results
                                     if r["outcome"] == "raised" and r["build"] == label]
                             for label in sorted({r["build"] for r in results})},
        "not_raised_or_completed": [r for r in results if r["outcome"] not in ("raised", "completed")],
    }
    print(json.dumps(record["summary"], indent=1), flush=True)
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


ARGS = None
if __name__ == "__main__":
    main()
