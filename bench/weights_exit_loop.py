"""Exit after a refused weight-sync round, counted (issue 36, item 4). Each
run starts `world` fresh interpreters over gloo (rank 0 a Sender, the others
Receivers): a good round, then a round every rank refuses with
MismatchError, then (--close) each rank closes its Communicator and the
process exits the ordinary way (no os._exit), so whatever is still alive
meets interpreter and C++ teardown. A run is clean when every rank saw
MismatchError and exited 0; "terminate called without an active exception"
(SIGABRT) counts as an abort.

Both aborts seen here end alike: a thread drops torch objects whose
destructor retakes the GIL after Python began to exit; CPython 3.11 ends
such a thread with pthread_exit, whose unwinding meets a noexcept C++ frame:
std::terminate.
  - --close: the torch transport's gloo waiter (a daemon thread) let go of
    its last job's Works only when close() woke it, racing the exit.
  - no --close, --compress auto: torch's ProcessGroupGloo::runLoop drops the
    last native collective's Work (~AsyncAllgatherWork) after the caller's
    wait returned; with the Communicator left open that can fall in
    Py_FinalizeEx.

  python -P bench/weights_exit_loop.py --runs 50 --world 2 --case dtype --close
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

# What round 1 refuses: a receive buffer's dtype, a name sent twice, shared
# receive buffers (all before any byte moves), a name no sender sent (at the
# round's end). "native": no weight sync; three native all_gathers of
# temporaries under auto, then exit (the shortest path to the no-close abort).
CASES = ("dtype", "twice", "overlap", "extra", "native")


def native_main(comm, rank: int, world: int) -> None:
    import torch

    def op():
        out = torch.empty(world * 64, dtype=torch.int64)
        comm.all_gather_single(out, torch.full((64,), rank, dtype=torch.int64))
        return out.tolist()
    for _ in range(3):
        if op() != [r for r in range(world) for _ in range(64)]:
            raise AssertionError("all_gather_single returned wrong data")
    print("RESULT returned 0.00", flush=True)


def rank_main(rank: int, world: int, port: int, case: str, close: bool, compress: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import portable_zip as pz
    from portable_zip.comm.errors import MismatchError
    from portable_zip.weights import Receiver, Sender

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    comm = pz.Communicator(compress=compress, timeout=20)
    if case == "native":
        return native_main(comm, rank, world)
    g = torch.Generator().manual_seed(port)  # fresh data per run, the same on every rank
    w0 = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    w1 = (w0.float() + 1e-3 * torch.randn(256, 64, generator=g)).to(torch.bfloat16)  # a delta round
    if rank == 0:
        eng = Sender(comm, bucket_bytes=4096)
        eng.send([("w", w0), ("b", w0[0].clone())], 0)
    else:
        eng = Receiver(comm)
        into = {"w": torch.zeros(256, 64, dtype=torch.bfloat16), "b": torch.zeros(64, dtype=torch.bfloat16)}
        eng.receive(into)
    t0 = time.monotonic()
    try:
        if rank == 0:
            eng.send([("w", w1), ("b", w1[0].clone())] + ([("w", w1)] if case == "twice" else []), 1)
        else:
            if case == "dtype":
                into["b"] = torch.zeros(64, dtype=torch.float16)
            elif case == "overlap":
                into["b"] = into["w"][3]
            elif case == "extra":
                into["extra"] = torch.zeros(3)
            eng.receive(into)
        what = "returned"
    except MismatchError:
        what = "MismatchError"
    except Exception as e:  # noqa: BLE001 - reported to the parent
        what = type(e).__name__
    print(f"RESULT {what} {time.monotonic() - t0:.2f}", flush=True)
    if close:
        comm.close()
    # then an ordinary exit, as a user's script ends


def one_run(world: int, case: str, close: bool, compress: str, timeout: float = 120.0) -> dict:
    """One job of `world` ranks: per rank its exit status, its RESULT line, and whether it aborted."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from harness.ranks import free_port  # the tests' held port (no other socket takes it before the store binds)

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), "--rank", str(r), "--world",
                               str(world), "--port", str(port), "--case", case, "--compress", compress]
                              + (["--close"] if close else []),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    out = []
    end = time.monotonic() + timeout
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            out.append({"rc": "hung", "result": "", "abort": False, "stderr": se[-300:]})
            continue
        res = next((ln.split(" ", 1)[1] for ln in so.splitlines() if ln.startswith("RESULT ")), "")
        out.append({"rc": p.returncode, "result": res, "abort": "terminate called" in se or p.returncode == -6,
                    "stderr": se[-300:]})
    want = "returned" if case == "native" else "MismatchError"
    return {"ranks": out, "clean": all(r["rc"] == 0 and r["result"].startswith(want) and not r["abort"]
                                       for r in out)}


def loop(runs: int, world: int, case: str, close: bool = True, compress: str = "always") -> dict:
    """`runs` jobs: how many were clean, aborted (any rank) or went otherwise wrong, and the first bad one."""
    counts, first_bad, slowest = collections.Counter(), None, 0.0
    t0 = time.monotonic()
    for _ in range(runs):
        r = one_run(world, case, close, compress)
        counts["clean" if r["clean"] else "abort" if any(x["abort"] for x in r["ranks"]) else "other"] += 1
        slowest = max([slowest] + [float(x["result"].split()[1]) for x in r["ranks"] if len(x["result"].split()) > 1])
        if not r["clean"] and first_bad is None:
            first_bad = r
    return {"runs": runs, "world": world, "case": case, "close": close, "compress": compress,
            "clean": counts["clean"], "abort": counts["abort"], "other": counts["other"],
            "slowest_refusal_s": round(slowest, 2), "seconds": round(time.monotonic() - t0, 1), "first_bad": first_bad}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--case", choices=CASES, default="dtype")
    ap.add_argument("--close", action="store_true", help="each rank closes its Communicator before it exits")
    ap.add_argument("--compress", choices=("always", "auto", "never"), default="always")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        rank_main(a.rank, a.world, a.port, a.case, a.close, a.compress)
    else:
        print(json.dumps(loop(a.runs, a.world, a.case, a.close, a.compress), indent=1))
