"""Run a function on N local processes with a hard deadline: the tests'
multi-process harness, which the communication benchmarks (bench/pzbench)
use too."""
from __future__ import annotations

import collections
import ctypes
import datetime
import os
import socket
import time
import traceback
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast (NVLS) off in every rank, for NCCL, symmetric memory and NVSHMEM.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def ok(results: dict) -> dict:
    """Each rank's value from a run's results ({rank: ("ok", value) | (status, why)});
    any rank that did not end "ok" fails the test, every such rank named."""
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, "\n".join(f"rank {r}: {s}: {v}" for r, (s, v) in bad.items())
    return {r: v[1] for r, v in results.items()}


def device() -> torch.device:
    """A rank's tensors' device: cuda (current) on NCCL groups, cpu on gloo;
    PZ_TEST_DEVICES ("cuda,cpu,...", one per rank) puts ranks of a gloo job
    on GPUs (mixed-cluster tests)."""
    spec = os.environ.get("PZ_TEST_DEVICES")
    if spec:
        return torch.device("cuda", 0) if spec.split(",")[dist.get_rank()] == "cuda" else torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# Ports handed out, each still bound (SO_REUSEADDR, never listening) so that no other
# socket on the host takes it before the rank's store binds it: the kernel skips a
# bound port when it picks one for bind(0) or connect(). The store's own bind also
# sets SO_REUSEADDR (libuv and torch's socket both do), so it binds through the hold.
# The oldest hold goes once 64 newer ones exist, long after its store bound.
_HELD = collections.deque(maxlen=64)


def free_port() -> int:
    """A TCP port on loopback for a local process group's store, held so that
    nothing else takes it between now and the store's bind (a CI run failed on
    EADDRINUSE when another job's ephemeral socket got the port in that gap)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    if len(_HELD) == _HELD.maxlen:
        _HELD[0].close()
    _HELD.append(s)
    return s.getsockname()[1]


def _entry(rank, world, port, environ, backend, pg_timeout, fn, args, queue):
    # A forked rank (forkserver) has its server's environment: take the caller's.
    os.environ.clear()
    os.environ.update(environ)
    if "MALLOC_MMAP_THRESHOLD_" in environ:  # glibc reads it at exec, which a forked rank skipped
        ctypes.CDLL(None).mallopt(-3, int(environ["MALLOC_MMAP_THRESHOLD_"]))  # M_MMAP_THRESHOLD
    if "OMP_NUM_THREADS" in environ:  # likewise OpenMP, loaded with torch
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    try:
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if "pz" in backend:
            import portable_zip  # noqa: F401  (registers the "pz" backend)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        queue.close()
        queue.join_thread()  # flush the result before the hard exit
        os._exit(0)  # skip process-group teardown, which can block when a peer is gone


def _context(backend):
    """gloo ranks fork from a server that imported torch once (stdlib
    forkserver, no CUDA), so a rank starts in milliseconds, not
    the ~2 s of CPU a fresh interpreter spends importing torch (on 2 cores:
    tests/test_comm.py 278 -> 135 s). What a process reads once at start
    comes from the server's environment, except what _entry re-applies
    (MALLOC_MMAP_THRESHOLD_, OMP_NUM_THREADS); settings read at run time
    follow the caller's. Other backends spawn a fresh interpreter, as CUDA
    wants."""
    if backend not in ("gloo", "pz"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy"] + (["portable_zip"] if backend == "pz" else []))
    return ctx


def run_ranks(world: int, fn, *args, env=None, backend=None, deadline: float = 580.0,
              pg_timeout: float = 300.0) -> dict:
    """Run fn(rank, world, *args) on `world` local processes (NCCL when there
    are enough GPUs, else gloo, unless backend says). Returns {rank: ("ok",
    value) | ("error", text) | ("hung", "")}: a rank silent at the deadline is killed."""
    ctx = _context(backend)
    queue = ctx.Queue()
    port = free_port()
    environ = {**os.environ, **SAFE_ENV, **(env or {})}
    procs = [ctx.Process(target=_entry, args=(r, world, port, environ, backend, pg_timeout, fn, args, queue),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    end = time.monotonic() + deadline
    while len(results) < world and time.monotonic() < end:
        try:
            rank, status, value = queue.get(timeout=max(0.1, min(1.0, end - time.monotonic())))
            results[rank] = (status, value)
        except Empty:
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    for r in range(world):
        results.setdefault(r, ("hung", ""))
    return results
