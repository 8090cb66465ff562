"""Hosts on one machine (portable_zip/netns.py, ci/netns): the shaped link's
limit as plain TCP measures it, and a mixed-domain job across two "hosts"
(network namespaces, 2 ranks each): Communicator(domains="host",
transport="auto") runs the hierarchical all_reduce, gloo inside each host and
the fabric engine (libfabric tcp;ofi_rxm on the veth) between them, every
result checked bit for bit with PZ_CHECK_PLANS=1.

This file is also the ranks' program: `python tests/test_netns.py mixed SEED`."""
import os
import sys
import time

import numpy as np
import pytest
import torch

from portable_zip import netns

WHY = netns.unavailable()
pytestmark = pytest.mark.skipif(bool(WHY), reason=f"no shaped link between namespaces here: {WHY}")
SIZES = [1, 4097, 60_013]
MODES = ("always", "auto")


def test_measured_limit_follows_the_configured_rate():
    """A functional check of the shaping (tc tbf), not of our speed: plain TCP
    gets most of the rate and never much more, and four times the rate moves
    clearly more."""
    got = {}
    for gbit in (0.25, 1.0):
        with netns.Link(hosts=2, gbit=gbit, delay_us=50) as link:
            got[gbit] = link.measure(seconds=1.5)
        assert 0.6 * gbit <= got[gbit]["gbit"] <= 1.1 * gbit, got
        assert 0 < got[gbit]["rtt_us"] < 100_000, got
    assert got[1.0]["gbit"] > 2.5 * got[0.25]["gbit"], got


def test_refuses_bad_arguments_before_touching_the_machine():
    for bad in (dict(hosts=1), dict(hosts=2, gbit=0), dict(hosts=2, delay_us=-1)):
        with pytest.raises(ValueError):
            netns.Link(**bad)
    with pytest.raises(netns.LinkError, match="not up"):
        netns.Link(2).run(["true"])


def test_ranks_get_their_host_and_a_bounded_run():
    """Each rank runs in its host's namespace under that host's name; a rank
    that fails ends the run within the grace, with its exit code."""
    show = "echo $(hostname) $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $PZ_NETNS_HOST; exit $((RANK == 3 ? 7 : 0))"
    with netns.Link(hosts=2, gbit=1) as link:
        ranks = link.run(["sh", "-c", show], per_host=2, timeout=60, echo=False)
        late = link.run(["sleep", "60"], timeout=1, echo=False)
    seen = [out[0] for out in ranks.out]
    assert seen == [f"pz-host-{r // 2} {r} 4 {r % 2} 10.213.0.1 {r // 2}" for r in range(4)], ranks.lines
    assert ranks.codes == [0, 0, 0, 7] and late.codes == [124, 124]


def test_mixed_domains_across_hosts():
    """4 ranks on 2 hosts: domains="host" gives [[0, 1], [2, 3]], the fabric
    carries what crosses hosts, and every all_reduce is bit-exact (below)."""
    seed = int(np.random.default_rng().integers(0, 2**31))
    env = {"PZ_CHECK_PLANS": "1", "PZ_FABRIC_PROVIDER": "tcp;ofi_rxm", "OMP_NUM_THREADS": "1"}
    with netns.Link(hosts=2, gbit=5) as link:
        ranks = link.run([sys.executable, os.path.abspath(__file__), "mixed", str(seed)], per_host=2, timeout=80,
                         env=env, echo=False)
    log = "\n".join(ranks.lines[-60:])
    assert ranks.codes == [0, 0, 0, 0], log
    res = ranks.results()
    checks = 2 * len(MODES) * len(SIZES) * 2 + len(MODES)
    assert len(res) == 4 and all(r["checks"] == checks for r in res), log
    assert all(r["domains"] == [[0, 1], [2, 3]] and "fabric" in r["backend"] for r in res), res


def _namespaces(tag: str) -> int:
    import subprocess
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return sum(1 for line in out.splitlines() if line.split() and line.split()[0].startswith(tag + "-"))


def _pid_ns_link(tmp_path, then: str):
    """A link built by a process inside a PID namespace of its own, which
    prints the link's tag, then runs `then`."""
    import subprocess
    code = f"from portable_zip import netns; l = netns.Link(2, gbit=1); l.up(); print(l.tag, flush=True); {then}"
    return subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", code],
                            stdout=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True)


def test_pid_namespaces_do_not_fool_the_stale_sweep(tmp_path):
    """Liveness by lock, not pid. A link built inside a PID namespace, where
    our pid means nothing, leaves our live run's namespaces alone; and once a
    run inside one is SIGKILLed (its pid there is 1, alive in any view), the
    next sweep removes its namespaces."""
    import signal
    with netns.Link(hosts=2, gbit=1) as mine:
        p = _pid_ns_link(tmp_path, "l.down()")
        assert p.stdout.readline().strip().startswith(netns.PREFIX) and p.wait(timeout=60) == 0
        assert _namespaces(mine.tag) == 3, "a live run's namespaces were taken for stale"
    p = _pid_ns_link(tmp_path, "import time; time.sleep(120)")
    try:
        tag = p.stdout.readline().strip()
        assert tag.startswith(netns.PREFIX) and _namespaces(tag) == 3, tag
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=20)
    end = time.monotonic() + 20  # the killed process's exit (and its lock's release) may trail its parent's
    while netns._owned(tag) and time.monotonic() < end:
        time.sleep(0.05)
    with netns.Link(hosts=2, gbit=1):
        assert _namespaces(tag) == 0, "a killed run's namespaces were left behind"


def _data(seed, rank, case, numel, dtype, integer=False):
    rng = np.random.default_rng([seed, rank, case])
    v = rng.integers(-8, 9, numel).astype(np.float32) if integer else rng.standard_normal(numel, dtype=np.float32)
    return torch.from_numpy(v * (1 if integer else 0.02)).to(dtype)


def _hier_sum(parts, domains):
    """The order hier_all_reduce documents: a native (one-rounding) sum inside
    each domain, then the domains' partials in domain order, accumulated in
    fp32 and rounded once."""
    acc = torch.zeros(parts[0].shape, dtype=torch.float32)
    for d in domains:
        acc += torch.stack([parts[r].float() for r in d]).sum(0).to(parts[0].dtype).float()
    return acc.to(parts[0].dtype)


def _mixed(seed: int) -> None:
    """One rank: all_reduce(SUM) of its own tensors in each mode, checked
    against the documented order bit for bit, against a float64 sum within
    the three roundings' bound, and equal on every rank; integer-valued data
    (exact in any order) against the exact sum."""
    import torch.distributed as dist

    import portable_zip as pz
    from datetime import timedelta

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    comms = {m: pz.Communicator(compress=m, transport="auto", domains="host", timeout=60) for m in MODES}
    doms = comms["always"].domains
    checks, case = 0, 0
    for dtype in (torch.bfloat16, torch.float16):
        for numel in SIZES:
            case += 1
            parts = [_data(seed, r, case, numel, dtype) for r in range(world)]
            exact = torch.stack([p.double() for p in parts])
            bound = exact.abs().sum(0) * 3 * torch.finfo(dtype).eps / 2  # three roundings, half an ulp each
            for mode, comm in comms.items():
                t = parts[rank].clone()
                comm.all_reduce(t)
                everyone = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(everyone, t)
                assert all(torch.equal(e.view(torch.int16), t.view(torch.int16)) for e in everyone), \
                    f"{mode} {dtype} {numel}: ranks differ"
                assert torch.equal(t.view(torch.int16), _hier_sum(parts, doms).view(torch.int16)), \
                    f"{mode} {dtype} {numel}: not the documented order's bits"
                assert ((t.double() - exact.sum(0)).abs() <= bound).all(), f"{mode} {dtype} {numel}: far off"
                checks += 2
    case += 1
    parts = [_data(seed, r, case, 30_011, torch.bfloat16, integer=True) for r in range(world)]
    for comm in comms.values():
        t = parts[rank].clone()
        comm.all_reduce(t)
        assert torch.equal(t, torch.stack(parts).sum(0)), "integer-valued all_reduce is not the exact sum"
        checks += 1
    backend = comms["always"].backend
    for comm in comms.values():
        comm.close()
    dist.destroy_process_group()
    netns.report({"rank": rank, "checks": checks, "domains": doms, "backend": backend})


if __name__ == "__main__" and sys.argv[1:2] == ["mixed"]:
    _mixed(int(sys.argv[2]))
