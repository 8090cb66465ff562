"""Run a function on N local processes over gloo, with a hard deadline."""
import datetime
import os
import traceback

import torch.multiprocessing as mp

from portable_zip.comm_bench import free_port


def _entry(fn, rank, world, port, queue, args, backend):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        queue.close()
        queue.join_thread()  # flush the result before the hard exit
        os._exit(0)  # skip gloo teardown, which can block when a peer is gone


def run(world: int, fn, *args, deadline: float = 240.0, backend: str = "gloo") -> dict:
    """{rank: ("ok", value) | ("error", text)}; a rank that reports nothing by
    the deadline is killed and reported as ("hung", "")."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args, backend), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    import queue as q
    import time

    end = time.monotonic() + deadline
    while len(results) < world and time.monotonic() < end:
        try:
            rank, status, value = queue.get(timeout=max(0.1, min(1.0, end - time.monotonic())))
            results[rank] = (status, value)
        except q.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    for r in range(world):
        results.setdefault(r, ("hung", ""))
    return results
