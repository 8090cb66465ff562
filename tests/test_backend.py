"""The "pz" torch.distributed backend on gloo: every op through dist.* at
2, 3 and 4 ranks in every mode, against torch's own results; mismatches,
a killed rank, destroy and re-init."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch.distributed as dist

import backend_workers
from harness.ranks import free_port, run_ranks
from harness.ranks import ok

ENV = {"OMP_NUM_THREADS": "1", "PZ_CHECK_PLANS": "1"}


def run(world, fn, *args, deadline=300.0, env=None):
    return run_ranks(world, fn, *args, env={**ENV, **(env or {})}, backend="pz", deadline=deadline, pg_timeout=120.0)


def test_registered_on_import():
    import portable_zip  # noqa: F401
    assert "pz" in dist.Backend.backend_list and dist.Backend("pz") == "pz"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_op_every_mode(world):
    seed = int(np.random.default_rng().integers(0, 2**31))  # fresh inputs every run
    numel = int(np.random.default_rng().integers(3000, 9000))
    res = ok(run(world, backend_workers.every_op, seed, numel, deadline=600))
    for r, (n, bad, digests) in res.items():
        assert not bad, f"seed {seed} rank {r}: {len(bad)} of {n} checks failed: {bad[:8]}"
        assert n > 100, n
        # compression changes no bit: compress="never" and "always" give the same bytes
        assert digests["never"] == digests["always"], f"seed {seed} rank {r}"
        if world == 2:  # auto too, where torch's own reduction rounds once like pz's
            assert digests["auto"] == digests["never"], f"seed {seed} rank {r}"
    # every rank holds the same all_reduce bytes
    first = [d for k, d in res[0][2]["always"] if k == "all_reduce"]
    assert first and all([d for k, d in res[r][2]["always"] if k == "all_reduce"] == first for r in res), seed


@pytest.mark.parametrize("kind", ["size", "dtype", "split"])
def test_mismatch_raises_on_every_rank(kind):
    res = ok(run(3, backend_workers.mismatch, kind, deadline=120))
    for r, v in res.items():
        assert v[0] in ("MismatchError", "PeerError", "PeerTimeout"), (r, v)
        assert v[1] < 30, (r, v)
    assert any(v[0] == "MismatchError" for v in res.values()), res


def test_killed_rank_raises_on_survivors():
    res = run(3, backend_workers.killed_rank, 2, deadline=120)
    for r in (0, 1):
        assert res[r][0] == "ok", res[r]
        kind, elapsed = res[r][1][:2]
        assert kind in ("PeerError", "PeerTimeout"), res[r]
        assert elapsed < 30, res[r]


def test_destroy_and_reinit():
    res = ok(run(2, backend_workers.reinit, free_port(), deadline=180))
    for v in res.values():
        assert v == [True, "pz", True, "pz"], v


def test_unserved_ops_raise_clearly():
    res = ok(run(2, backend_workers.unserved, deadline=120))
    for errs in res.values():
        assert len(errs) == 2, errs
        assert "recv from any source" in errs[0], errs
        assert "pg_options must be portable_zip.c10d.Options" in errs[1], errs


@pytest.mark.parametrize("spec,devices,served", [("cpu:gloo,cuda:pz", ["cuda"], []), ("cpu:pz", ["cpu"], ["cpu"])])
def test_device_map(spec, devices, served):
    res = ok(run_ranks(2, backend_workers.device_map, env=ENV, backend=spec, deadline=180, pg_timeout=60.0))
    for v in res.values():
        assert v == ("ProcessGroupPZ", devices, served, True), v


def test_torch_import_registers_the_backend():
    """The wheel's "torch.backends" entry point: `import torch` alone registers pz."""
    code = "import sys, torch.distributed as d; print('pz' in d.Backend.backend_list, 'portable_zip' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.stdout.split() == ["True", "True"], out
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/",
                         env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert off.stdout.split() == ["False", "False"], off


@pytest.mark.parametrize("world,mode", [(2, "always"), (3, "auto"), (4, "never"), (3, "always")])
def test_point_to_point_matches_as_torch(world, mode):
    seed = int(np.random.default_rng().integers(0, 2**31))
    res = ok(run(world, backend_workers.p2p_semantics, seed, mode, deadline=240))
    for r, (n, bad, plans) in res.items():
        assert not bad and n >= 3, (seed, r, bad)
        if mode == "always":
            assert plans["send"].get("compressed", 0) >= 1, plans
        if mode == "never":  # every message carries its frame (dtype, size): raw, never torch's bare send
            assert set(plans["send"]) == {"raw"}, plans


def test_point_to_point_mismatch_raises_on_both_ranks():
    res = ok(run(2, backend_workers.p2p_mismatch, deadline=120))
    for r in (0, 1):  # the receiver refuses the message; its ACK tells the sender why
        assert res[r][0] == "MismatchError", res
        assert "bfloat16[100000]" in res[r][1] and "float16[100000]" in res[r][1], res


def test_torch_paths_layouts_and_forwarded_ops():
    seed = int(np.random.default_rng().integers(0, 2**31))
    res = ok(run(2, backend_workers.torch_paths, seed, deadline=180))
    for r, v in res.items():
        assert v == [True, True, True, True, True, True, True, "pz"], (seed, r, v)


@pytest.mark.parametrize("world", [2, 3])
def test_native_ops_take_the_thin_path_with_gloos_bytes(world):
    """PZ_CHECK_PLANS=0 (users' default; with it on every op agrees its spec
    on the full path), a codec said to be slow and a margin that asks a
    compressed plan to be 100x faster, so auto sends every op native: torch's
    all_gather, timed at calibration on a loaded machine, can take longer than
    the model's two latency rounds of a compressed one, even for 30 bytes."""
    seed = int(np.random.default_rng().integers(0, 2**31))
    env = {"PZ_CHECK_PLANS": "0", "PZ_CODEC_GBPS": "0.01", "PZ_POLICY_MARGIN": "0.99"}
    res = ok(run(world, backend_workers.thin_native, seed, env=env, deadline=240))
    for r, (n, bad, plans, held, kinds) in res.items():
        assert n == 3 * 2 * 3 * 2 * 6 and not bad, (seed, r, bad)
        want = {"all_reduce": 37, "broadcast": 36, "all_gather": 72, "reduce_scatter": 72}
        for op, calls in want.items():
            assert plans[op] == {"native": calls}, (r, op, plans)
        assert held <= 2, f"rank {r}: {held} finished works still held by the order bookkeeping"
        assert kinds == {"all_reduce": "Work", "reduce_scatter": "Joined"}, kinds


def test_bad_options_raise_where_the_group_is_made():
    from portable_zip.c10d import Options
    for bad in ({"compress": "fast"}, {"transport": "nccl"}, {"max_sms": 0}, {"domains": "bogus"}):
        with pytest.raises(ValueError, match="Options"):
            Options(**bad)


def test_an_unfinished_work_at_the_front_pins_nothing_behind_it():
    """The order bookkeeping drops finished works from the front; past a few
    dozen held, from anywhere: a receive still waiting (or a Work that never
    says it finished) must not keep every later op, and its tensors, alive."""
    import torch

    from portable_zip.c10d.order import Running

    class W:
        def __init__(self, done):
            self.done = done

        def is_completed(self):
            return self.done

    run = Running()
    stuck = W(False)
    run.add(stuck, [torch.zeros(4)])
    for _ in range(200):
        run.add(W(True), [torch.zeros(4)])
    assert len(run) <= Running.SWEEP + 1, len(run)
    assert run._works[0][0] is stuck  # still held: later ops on its tensor wait for it
