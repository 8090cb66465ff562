"""The fabric transport over libfabric's tcp;ofi_rxm on loopback (CPU ranks,
gloo for the job): every op and dtype at 2-4 ranks bit-exact against gloo,
mixed domains, the staging ring's edges, a peer killed mid-transfer, and
clear errors for a bad provider, a missing library or mismatched settings."""
import subprocess

import numpy as np
import pytest

import comm_harness
import fabric_workers
import portable_zip as pz
from portable_zip import _C
from harness.ranks import ok

pytestmark = pytest.mark.skipif(not _C.has_fabric or bool(_C.fabric_probe()),
                                reason=f"no fabric transport here: {_C.fabric_probe()}")
TCP = {"PZ_FABRIC_PROVIDER": "tcp;ofi_rxm"}


def run(world, fn, *args, env=None, deadline=300.0):
    return comm_harness.run(world, fn, *args, env={**TCP, **(env or {})}, deadline=deadline)


def seed():
    return int(np.random.default_rng().integers(0, 2**31))


def test_library_is_loaded_at_run_time():
    """The engine binds libfabric with dlopen/dlvsym: the extension must not link it."""
    out = subprocess.run(["nm", "-D", "--undefined-only", _C.__file__], capture_output=True, text=True, check=True)
    assert not [l for l in out.stdout.splitlines() if l.split()[-1].startswith("fi_")], out.stdout


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_op_every_dtype_over_fabric(world):
    rng = np.random.default_rng()
    sizes = [0, 1, 4097, int(rng.integers(5, 40_000)) | 1]
    res = ok(run(world, fabric_workers.fabric_battery, seed(), sizes, None, ("always", "never", "auto"), deadline=600))
    expected = 3 * (len(sizes) * (4 * 5 + 2 * 4 * 3) + 2)
    assert all(n == expected for n, _ in res.values()), (expected, res)
    assert "tcp;ofi_rxm" in res[0][1]


@pytest.mark.parametrize("world", [2, 3])
def test_auto_measures_its_host_cost_per_exchange(world):
    res = ok(run(world, fabric_workers.measured_exchange))
    assert len(set(res.values())) == 1, res


@pytest.mark.parametrize("world", [2, 3])
def test_raw_slower_than_predicted_is_rejudged_alike(world):
    res = ok(run(world, fabric_workers.raw_rejudged, seed()))
    plans, factors = res[0]
    assert all(v == res[0] for v in res.values()), res  # the same plans and factors on every rank
    assert plans[:4] == ["raw"] * 4 and plans[-1] == "compressed", plans
    assert len(set(factors)) == 1 and factors[0][0] > 1.5 and factors[0][1] == 1.0, factors


@pytest.mark.parametrize("world,domains", [(4, [[0, 1], [2, 3]]), (3, [[0], [1, 2]]), (4, [[0, 2], [1, 3]])])
def test_mixed_domains(world, domains):
    """Two 'vendors' of CPU ranks: gloo inside each domain, fabric between;
    equal domains run the hierarchical all_reduce."""
    sizes = [0, 3, 20_011]
    res = ok(run(world, fabric_workers.fabric_battery, seed(), sizes, domains, ("always", "never"), deadline=600))
    expected = 2 * (len(sizes) * (4 * 5 + 2 * 4 * 3) + 2)
    assert all(n == expected for n, _ in res.values()), (expected, res)
    assert str(domains) in res[0][1] or "domains" in res[0][1]


@pytest.mark.parametrize("world,rails", [(2, 3), (3, 1)])
def test_staging_ring_edges(world, rails):
    env = {"PZ_FABRIC_STAGE": "1", "PZ_FABRIC_CHUNK": str(64 << 10), "PZ_FABRIC_RAILS": str(rails),
           "PZ_FABRIC_DEPTH": "2"}
    res = ok(run(world, fabric_workers.staged_edges, seed(), env=env))
    assert all(n == 2 * 9 * 3 * 2 * (world - 1) for n, _ in res.values()), res
    assert res[0][1]["rails"] == str(rails) and res[0][1]["chunk"] == str(64 << 10)


def test_killed_peer_raises_on_every_survivor():
    res = run(3, fabric_workers.killed_mid_transfer, 5.0, deadline=90)
    for r in (0, 1):
        assert res[r][0] == "ok", res[r]
        elapsed, kind, msg = res[r][1]
        assert elapsed < 5.0 + 5, (elapsed, msg)
        assert kind in ("PeerError", "PeerTimeout"), msg
    assert res[2][0] != "ok"


def test_unknown_provider_is_a_clear_error():
    res = ok(run(2, fabric_workers.construct_error, env={"PZ_FABRIC_PROVIDER": "no-such-provider"}, deadline=60))
    for elapsed, kind, msg in res.values():
        assert kind == "RuntimeError" and "no-such-provider" in msg and "providers this host offers" in msg, msg
        assert "tcp" in msg.split("providers this host offers")[1], msg


def test_missing_library_is_a_clear_error():
    res = ok(run(2, fabric_workers.construct_error, env={"PZ_FABRIC_LIBRARY": "/nonexistent/libfabric.so.1"},
                 deadline=60))
    for elapsed, kind, msg in res.values():
        assert kind == "RuntimeError" and "libfabric" in msg and "apt-get install libfabric1" in msg, msg


def test_mismatched_settings_raise_on_both():
    res = ok(run(2, fabric_workers.settings_mismatch, deadline=60))
    for elapsed, kind, msg in res.values():
        assert kind == "MismatchError" and "PZ_FABRIC_RAILS" in msg, msg


def test_domain_arguments_are_checked():
    res = ok(run(2, fabric_workers.domain_errors, deadline=60))
    for msgs in res.values():
        assert "accepted" not in msgs, msgs
        assert "missing [1]" in msgs[0] and "two domains" in msgs[1] and "not a rank" in msgs[2], msgs


def test_backend_info_reports_the_fabric():
    info = pz.backend_info()
    assert info["fabric"] in ("available", "unavailable") and (info["fabric"] == "available") == (not _C.fabric_probe())


def test_different_domains_raise_mismatch_on_every_rank():
    res = ok(run(3, fabric_workers.domains_disagree, deadline=90))
    for elapsed, msg in res.values():
        assert elapsed < 15 and "domains= differs" in msg, (elapsed, msg)


def test_failed_exchange_cancels_its_posted_waves():
    res = ok(run(2, fabric_workers.fail_mid_exchange, deadline=120))
    first, later = res[1]
    assert "corrupt" in first or "checksum" in first or "unreadable" in first, first
    assert "failed earlier" in later, later
