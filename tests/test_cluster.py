"""Two "hosts" (network namespaces behind a shaped link), each with the
/etc/hosts Debian and Ubuntu install (its own name at 127.0.1.1), launched
as a user would launch a two-node job:

- `torchrun --nnodes 2` with c10d rendezvous at the first host's name,
  GLOO_SOCKET_IFNAME set, DDP and FSDP2 over "pz" (compress="always",
  transport="fabric"): both nodes exit 0, the parameters equal the plain gloo
  run's bit for bit after every step, and the stats show what was compressed;
- with no interface setting at all, the listener follows the route to
  MASTER_ADDR, and the master's host (whose route there is loopback) takes
  the route to the other host;
- a rank whose listener its peer cannot reach: every rank raises PeerError
  within seconds, naming the peer, the address and the setting; none waits
  out its timeout.

This file is also the last two cases' rank program: `python tests/test_cluster.py route|unreachable`."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from portable_zip import netns

WHY = netns.unavailable()
pytestmark = pytest.mark.skipif(bool(WHY), reason=f"no namespaces here: {WHY}")
HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 6
ENV = {"PZ_CHECK_PLANS": "1", "OMP_NUM_THREADS": "1", "PZ_FABRIC_PROVIDER": "tcp;ofi_rxm", "PZ_STATS": "1"}


def _torchrun() -> list:
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def test_two_node_torchrun_on_debian_hosts(tmp_path):
    cmd = _torchrun() + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", "pz-host-0:29517", "--rdzv-id", "pz-cluster-test", "--max-restarts", "0",
                         os.path.join(HERE, "cluster_worker.py"), str(tmp_path), str(STEPS)]
    with netns.Link(hosts=2, gbit=1, debian_hosts=True) as link:
        ranks = link.run(cmd, timeout=240, env=ENV, echo=False)
    log = "\n".join(ranks.lines[-80:])
    assert ranks.codes == [0, 0], log
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(r["host"] for r in res) == ["pz-host-0", "pz-host-1"], res
    for r in res:
        runs = {(x["wrapping"], x["backend"]): x for x in r["runs"]}
        for w, ops in (("ddp", {"dp": ("all_reduce",)}), ("fsdp", {"shard": ("all_gather", "reduce_scatter")})):
            plain, pz = runs[(w, "gloo")], runs[(w, "pz")]
            assert len(pz["fingerprints"]) == STEPS and pz["fingerprints"] == plain["fingerprints"], \
                f"rank {r['rank']}: {w} over pz differs from gloo"
            for group, names in ops.items():
                st = pz["group_stats"][group]["cpu"]
                for op in names:
                    s = st[op]
                    assert s["calls"] > 0 and s["wire_bytes"] < s["raw_bytes"], (w, op, s)
    # PZ_STATS=1: each pz group said what it moved at destroy_process_group, on both nodes.
    for r in range(2):
        said = [l for l in ranks.out[r] if l.startswith("pz stats, group")]
        assert len(said) >= 2 and all("compressed" in l for l in said), ranks.out[r][-20:]
    # The same fingerprints on both nodes: the replicas agree.
    assert [x["fingerprints"] for x in res[0]["runs"]] == [x["fingerprints"] for x in res[1]["runs"]]


def test_with_no_interface_setting_the_route_to_the_master_decides():
    """MASTER_ADDR as torchrun's c10d rendezvous sets it: the first host's
    name, which that host itself resolves to 127.0.1.1."""
    with netns.Link(hosts=2, gbit=1, debian_hosts=True) as link:
        ranks = link.run([sys.executable, os.path.abspath(__file__), "route"], timeout=60, echo=False)
    assert ranks.codes == [0, 0], "\n".join(ranks.lines)
    got = [r["listen"] for r in ranks.results()]
    assert got[0][0] == "10.213.0.1" and "route to rank 1's address 10.213.0.2" in got[0][1], got
    assert got[1][0] == "10.213.0.2" and "route to MASTER_ADDR pz-host-0" in got[1][1], got


def test_an_unreachable_listener_fails_every_rank_within_seconds():
    """Host 0 listens on an address host 1 has no route to (PZ_IFACE names a
    host-0-only interface): rank 1's dial fails, and rank 0, which would
    wait for it, raises too, both naming each other, long before the 120 s timeout."""
    with netns.Link(hosts=2, gbit=1, debian_hosts=True) as link:
        ns0 = link.names[0]
        # An interface of host 0 alone (a veth pair inside it: kernels without the dummy module have veths).
        for args in (["link", "add", "pzdummy", "type", "veth", "peer", "name", "pzdummy1"],
                     ["addr", "add", "10.99.0.1/32", "dev", "pzdummy"], ["link", "set", "pzdummy", "up"],
                     ["link", "set", "pzdummy1", "up"]):
            subprocess.run(["ip", "-n", ns0, *args], check=True, timeout=20)
        t0 = time.monotonic()
        ranks = link.run([sys.executable, os.path.abspath(__file__), "unreachable"], timeout=100, grace=60,
                         env={**ENV, "PZ_TIMEOUT": "120"}, echo=False)
        took = time.monotonic() - t0
    log = "\n".join(ranks.lines)
    assert ranks.codes == [3, 3], log
    assert took < 40, f"{took:.0f} s: a rank waited\n{log}"
    out = [" ".join(o) for o in ranks.out]
    assert "PeerError" in out[1] and "rank 0 (global 0) at 10.99.0.1:" in out[1] and "PZ_IFACE=pzdummy" in out[1], log
    assert "PeerError" in out[0] and "rank 1 (global 1) failed while the group was being built" in out[0], log


def _route() -> None:
    """Each host: its candidate alone (no interface variable set), swapped
    through files, then the choice."""
    from portable_zip.comm import address
    from portable_zip.comm.settings import Settings

    host = int(os.environ["PZ_NETNS_HOST"])
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                                                            "TP_SOCKET_IFNAME", "PZ_IFACE", "PZ_FABRIC_IFACE")}
    env["MASTER_ADDR"] = "pz-host-0"  # netns sets the address; torchrun's rendezvous gives the name
    mine = address.candidate(Settings.from_env(env))
    addrs = [a for a in os.environ["PZ_NETNS_ADDRS"].split(",")]
    # The other host's candidate is its address on the link (it is not on the master's host).
    cands = [mine.ip if h == host else ("" if h == 0 else addrs[h]) for h in range(2)]
    got = address.choose(mine, ["pz-host-0", "pz-host-1"], cands, host)
    print(netns._MARK + json.dumps({"listen": [got.ip, got.why]}), flush=True)


def _unreachable() -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import portable_zip as pz

    host = int(os.environ["PZ_NETNS_HOST"])
    if host == 0:
        os.environ["PZ_IFACE"] = "pzdummy"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        pz.Communicator(transport="fabric", device=torch.device("cpu"))
    except pz.PeerError as e:
        print(f"PeerError: {e}", flush=True)
        sys.exit(3)
    sys.exit(0)


if __name__ == "__main__":
    {"route": _route, "unreachable": _unreachable}[sys.argv[1]]()
