"""The pz backend's native gate (portable_zip/c10d/gate.cpp): native ops
that torch dispatches to C++ and that never enter Python, with gloo's bytes,
in order, counted in the stats; and the Python thin path where it is off."""
import os

import numpy as np
import pytest

import gate_workers
from harness.ranks import ok, run_ranks

# auto sends every op native (as in test_backend's thin-path test): a codec
# said to be slow, and a margin that asks a compressed plan to be 100x faster.
ENV = {"OMP_NUM_THREADS": "1", "PZ_CHECK_PLANS": "0", "PZ_CODEC_GBPS": "0.01", "PZ_POLICY_MARGIN": "0.99"}


def _gate_built():
    from portable_zip.c10d import native
    if native.load() is None:
        if os.environ.get("PZ_EXPECT_GATE") == "1":  # CI builds it (ci/test): its absence is a failure there
            pytest.fail(native.reason())
        pytest.skip(native.reason())


def _run(world, seed, env):
    return ok(run_ranks(world, gate_workers.gate_paths, seed, env={**ENV, **env}, backend="pz", deadline=300,
                        pg_timeout=120.0))


@pytest.mark.parametrize("world", [2, 3])
def test_native_ops_go_through_the_gate_with_gloos_bytes(world):
    _gate_built()
    seed = int(np.random.default_rng().integers(0, 2**31))
    for r, (n, bad, posted, plans, how, ops) in _run(world, seed, {}).items():
        assert n > 400 and not bad, (seed, r, bad[:8])
        assert how.startswith("native gate"), how
        # The first op of a signature, one after a full-path op, and one after an op Python ran while
        # others were in flight come through Python; a steady stream goes through the gate but its first.
        mixed, steady = posted
        assert 0 < mixed < ops and steady == 99, (r, posted, ops)
        assert plans == {"all_reduce": {"native": 1 + 160 + 16 + 100}, "broadcast": {"native": 80},
                         "all_gather": {"native": 160}}, (r, plans)


def test_without_the_gate_the_python_path_gives_the_same():
    seed = int(np.random.default_rng().integers(0, 2**31))
    for r, (n, bad, posted, plans, how, ops) in _run(2, seed, {"PZ_NATIVE_GATE": "0"}).items():
        assert n > 400 and not bad, (seed, r, bad[:8])
        assert posted == (0, 0) and how == "Python thin path: PZ_NATIVE_GATE=0", (posted, how)
        assert plans["all_gather"] == {"native": 160}, plans


def test_python_ops_after_the_gates_on_the_same_storage():
    _gate_built()
    seed = int(np.random.default_rng().integers(0, 2**31))
    res = ok(run_ranks(2, gate_workers.gate_then_python, seed, env=ENV, backend="pz", deadline=240, pg_timeout=120.0))
    for r, (n, bad, posted) in res.items():
        assert n == 31 and not bad, (seed, r, bad[:8])
        assert posted >= 1, (r, posted)  # the async op of some cases went through the gate
