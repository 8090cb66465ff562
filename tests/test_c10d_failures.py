"""The pz backend under failure and disorder (issue 36): a killed DDP rank
makes every survivor raise PeerError naming it, never crash; programs that
read the group's stats exit with status 0, never "terminate called without
an active exception"; async ops on one tensor run in call order when auto
mixes native and compressed plans; every op gloo does works through pz, and
under "cpu:gloo,cuda:pz" CPU tensors get gloo's own behaviour.

The loops run a few times in CI; PZ_TEST_LOOPS=1 runs the issue's counts
(20 killed-rank runs at 2 ranks and 20 at 3, 50 exits)."""
import os
import socket
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist

import c10d_failure_workers as workers
from harness.ranks import run_ranks

FULL = os.environ.get("PZ_TEST_LOOPS") == "1"
ENV = {"OMP_NUM_THREADS": "1", "PZ_CHECK_PLANS": "1"}
SLOW_LINK = {"PZ_LINK_GBPS": "0.05", "PZ_CODEC_GBPS": "50", "PZ_LINK_LATENCY_US": "200"}  # auto compresses big ops


def _seed() -> int:
    return int(np.random.default_rng().integers(0, 2**31))


# --- 1. DDP over pz, a rank killed mid-training ---------------------------------------------------------
# (mode, env): "auto" alone keeps these buckets native on loopback, with SLOW_LINK it compresses them;
# PZ_CHECK_PLANS=0 (users' default) lets native plans return torch's own Work, which DDP then holds.
NO_CHECK = {"PZ_CHECK_PLANS": "0"}
DDP_MODES = [("always", {}), ("never", {}), ("auto", NO_CHECK), ("auto", {**SLOW_LINK, **NO_CHECK})]


@pytest.mark.parametrize("world,runs", [(2, 20 if FULL else 4), (3, 20 if FULL else 2)])
def test_killed_ddp_rank_makes_survivors_raise_peer_error(world, runs):
    victim, seen = world - 1, []
    for i in range(runs):
        mode, env = DDP_MODES[i % len(DDP_MODES)]
        seed = _seed()
        res = run_ranks(world, workers.killed_ddp, seed, mode, victim, env={**ENV, **env}, backend="pz",
                        deadline=180, pg_timeout=60.0)
        for r in range(world):
            if r == victim:
                continue
            status, v = res[r]
            # "hung" is a survivor that never answered: before the fix it died of SIGSEGV in the reducer
            assert status == "ok", f"run {i} ({mode} {env}, seed {seed}) rank {r}: {status} {v}"
            kind, after, msg = v
            assert kind == "PeerError" and f"rank {victim}" in msg, f"run {i} ({mode}) rank {r}: {v}"
            assert after < 20, v
            seen.append(after)
    print(f"{world} ranks: {runs} killed-rank runs, {len(seen)} survivors raised PeerError, "
          f"slowest {max(seen):.2f} s after the kill")


def test_a_failed_future_raises_where_torch_reads_its_tensors():
    """torch's reducer takes a Python future's tensors by pickling its value
    (_extract_tensors): a failed op's value raises there instead of giving
    none (the reducer indexed the empty list), and wait() raises the op's error."""
    from torch._jit_internal import _extract_tensors

    from portable_zip.c10d import torch_work as works
    from portable_zip.comm.errors import PeerError

    fut = torch.futures.Future()
    works.fail(fut, PeerError("rank 1 died"))
    with pytest.raises(PeerError, match="rank 1 died"):
        fut.wait()
    with pytest.raises(PeerError, match="rank 1 died"):
        _extract_tensors(works._Failed(PeerError("rank 1 died")))


# --- 4b. exits after reading the stats -----------------------------------------------------------------
def test_the_gloo_waiter_lets_go_of_a_job_before_its_caller_goes_on():
    """The waiter is a daemon thread: a job's torch Works freed there while
    Python exits retake the GIL inside their destructor, and the thread ends
    in std::terminate. So it drops each job before waking its caller."""
    from portable_zip.comm.transports.torch import _Waiter

    class Held:
        pass
    refs = []

    def job():
        held = Held()
        refs.append(weakref.ref(held))
        return lambda: held
    waiter = _Waiter()
    fn = job()
    done, box = waiter.submit(fn)
    del fn
    assert done.wait(30) and not box
    assert refs[0]() is None, "the waiter still holds the job it finished"
    waiter.stop()


def test_a_p2p_future_thread_lets_go_of_its_works_before_completing():
    from portable_zip.c10d import torch_work as works

    class Done(dist.Work):
        def wait(self, timeout=None):
            return True
    w = Done()
    ref = weakref.ref(w)
    j = works.Joined([w], [])
    del w
    fut = j.get_future()
    del j
    freed = threading.Event()
    fut.add_done_callback(lambda f: ref() is None and freed.set())  # runs on the future's thread
    fut.wait()
    assert freed.wait(10), "the future completed while its thread still held the Works"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_and_fsdp2_exit_cleanly_after_reading_stats():
    runs, bad = 50 if FULL else 4, []
    here = os.path.dirname(os.path.abspath(__file__))
    for i in range(runs):
        kind, mode = ("ddp", "fsdp")[i % 2], ("auto", "always", "never")[i % 3]
        how = ("pz.stats", "group.stats")[i // 2 % 2]
        env = {**os.environ, **ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "WORLD_SIZE": "2"}
        procs = [subprocess.Popen([sys.executable, "-P", os.path.join(here, "c10d_failure_workers.py"), kind, mode,
                                   how], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r in range(2)]
        for r, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            if p.returncode != 0 or "terminate called" in err or not out.startswith("ops"):
                bad.append(f"run {i} ({kind} {mode} {how}) rank {r}: exit {p.returncode}: {err[-600:]}")
    assert not bad, f"{len(bad)} of {2 * runs} processes:\n" + "\n".join(bad)
    print(f"{runs} runs, {2 * runs} processes, 0 aborts")


# --- 5. order on one tensor -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "always", "never"])
def test_async_ops_on_one_tensor_run_in_call_order(mode):
    """PZ_CHECK_PLANS=0: with it on, auto queues every op (its idle native fast path is off)."""
    seed = _seed()
    env = {**ENV, "PZ_CHECK_PLANS": "0", **SLOW_LINK}
    res = run_ranks(2, workers.order, seed, 3, mode, env=env, backend="pz", deadline=300, pg_timeout=60.0)
    for r, (status, v) in res.items():
        assert status == "ok", (r, status, v)
        wrong, checks, stats, straddled = v
        assert not wrong, f"seed {seed} rank {r}: {len(wrong)} of {checks} wrong: {wrong[:6]}"
        assert checks >= 40, checks
        if mode == "auto":  # the threshold is straddled: both plans ran, on one tensor
            plans = stats["all_reduce"]["plans"]
            assert plans.get("compressed", 0) > 0, plans
            # A machine whose calibration codes even 128-byte all_reduces (a loaded
            # 2-core CI run, once) has no native plan to mix in: the order checks above still ran.
            assert plans.get("native", 0) > 0 or not straddled, plans


# --- 6. whatever gloo does ------------------------------------------------------------------------------
# check "0": users' default, where auto's native ops take the backend's thin path.
@pytest.mark.parametrize("spec,check", [("pz", "1"), ("pz", "0"), ("cpu:gloo,cuda:pz", "1")])
def test_every_op_gloo_does_works_through_pz(spec, check):
    seed = _seed()
    env = {**ENV, "PZ_CHECK_PLANS": check}
    res = run_ranks(2, workers.gloo_parity, seed, 64, None if spec == "pz" else spec, env=env, backend=spec,
                    deadline=300, pg_timeout=60.0)
    for r, (status, v) in res.items():
        assert status == "ok", (r, status, v)
        cases, bad = v
        assert cases > 200 and not bad, f"seed {seed} rank {r}: {len(bad)} of {cases}:\n" + "\n".join(bad[:20])
