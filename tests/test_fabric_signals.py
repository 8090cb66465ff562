"""Loading libfabric must leave the process's signal handlers alone.
Debian's libfabric pulls in libinfinipath, which installs handlers for
SIGINT, SIGTERM, SIGSEGV, ... that end the process at once (status 1: no
KeyboardInterrupt, no finally, no user's handler). Each check runs in fresh
processes."""
from __future__ import annotations

import ctypes
import inspect
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.ranks import free_port

from portable_zip import _C

pytestmark = pytest.mark.skipif(not _C.has_fabric or bool(_C.fabric_probe()),
                                reason=f"no fabric transport here: {_C.fabric_probe()}")
TCP = {"PZ_FABRIC_PROVIDER": "tcp;ofi_rxm", "OMP_NUM_THREADS": "1"}


def dispositions() -> dict:
    """Every signal's C-level disposition (handler, flags, mask), as libc's sigaction reads it."""
    libc = ctypes.CDLL(None, use_errno=True)
    out = {}
    for s in range(1, signal.NSIG):
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        buf = ctypes.create_string_buffer(512)  # larger than any libc's struct sigaction
        if libc.sigaction(s, None, buf) == 0:
            # glibc (x86_64, aarch64): handler, sa_mask (the kernel's 64 bits of its 1024; libc
            # copies the rest from uninitialised memory), sa_flags less SA_RESTORER (libc's own)
            flags = int.from_bytes(buf.raw[136:140], sys.byteorder) & ~0x04000000
            out[s] = (buf.raw[:8], buf.raw[8:16], flags)
    return out


def _env() -> dict:
    """The children's environment, without a user's IPATH_NO_BACKTRACE (the engine must cope alone)."""
    return {**{k: v for k, v in os.environ.items() if k != "IPATH_NO_BACKTRACE"}, **TCP}


def _rank(rank: int, port: int) -> None:
    """A rank that installed a SIGTERM handler before importing portable_zip,
    ran a fabric all_reduce, and now sleeps: SIGTERM must reach the handler,
    SIGINT must raise KeyboardInterrupt and run `finally`."""
    def on_term(signum, frame):
        print("user SIGTERM handler ran", flush=True)
        os._exit(0)

    import faulthandler
    faulthandler.enable(all_threads=True)  # SIGABRT from the test: every thread's stack, if this rank hangs
    signal.signal(signal.SIGTERM, on_term)
    # Python's own SIGINT handler, as a shell's foreground job gets it: a
    # parent that ignores SIGINT (nohup, a background job of a script)
    # passes that on, and Python then installs none.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch
    import torch.distributed as dist

    import portable_zip as pz

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = pz.Communicator(compress="never", transport="fabric", timeout=60)
    t = torch.full((1 << 16,), float(rank + 1))
    comm.all_reduce(t)
    assert comm.tp.name.startswith("libfabric/") and bool((t == 3).all()), (comm.tp.name, t[:4])
    dist.barrier()
    try:  # "ready" inside: a SIGINT sent once it is read lands in the try, never before it
        print("ready", flush=True)
        # Short sleeps: a signal whose handler runs just before a sleep's
        # system call starts is acted on at the next, not after 120 s.
        for _ in range(1200):
            time.sleep(0.1)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
    finally:
        print("finally ran", flush=True)
    os._exit(0)


def test_signals_reach_python_after_a_fabric_op():
    """Rank 0 gets SIGTERM (its own handler, installed before the import,
    must run), rank 1 SIGINT (KeyboardInterrupt, then finally)."""
    port = free_port()
    # The rank's own code alone (this module would load libfabric at import, before the handler).
    code = "import os, signal, sys, time\n" + inspect.getsource(_rank) + "_rank(int(sys.argv[1]), int(sys.argv[2]))\n"
    procs = [subprocess.Popen([sys.executable, "-P", "-c", code, str(r), str(port)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line.strip() == "ready", (line, p.poll(), p.stderr.read() if p.poll() is not None else "")
        procs[0].send_signal(signal.SIGTERM)
        procs[1].send_signal(signal.SIGINT)
        outs = []
        for r, p in enumerate(procs):
            try:
                outs.append(p.communicate(timeout=60))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGABRT)
                _, err = p.communicate(timeout=30)
                pytest.fail(f"rank {r} still ran 60 s after its signal; its threads at SIGABRT:\n{err[-6000:]}")
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0 and "user SIGTERM handler ran" in outs[0][0], (procs[0].returncode, outs[0])
    assert procs[1].returncode == 0, (procs[1].returncode, outs[1])
    assert "KeyboardInterrupt" in outs[1][0] and "finally ran" in outs[1][0], outs[1]


def test_backend_info_keeps_every_disposition():
    """pz.backend_info() loads libfabric: every signal's disposition after it
    equals the one before (psm's libinfinipath, among others, would replace
    SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL and SIGABRT)."""
    code = ("import ctypes, signal, sys\n" + inspect.getsource(dispositions) +
            "import portable_zip as pz\n"  # the import does not load libfabric; backend_info does
            "before = dispositions(); info = pz.backend_info(); after = dispositions()\n"
            "assert info['fabric'] == 'available', info\n"
            "print('changed', [s for s in before if before[s] != after.get(s)])\n")
    r = subprocess.run([sys.executable, "-P", "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "changed []" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])

