"""Where listeners bind (portable_zip/comm/address.py): the settings' order,
NCCL's interface rules, never loopback across hosts, the master's host
routing to another host, and PZ_PORT_RANGE for the watch and the fabric.
The two-host cases on real namespaces are tests/test_cluster.py."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from portable_zip import _C
from portable_zip.comm import address
from portable_zip.comm.address import Listen
from portable_zip.comm.settings import Settings

IFACES = _C.interfaces()
LO = next(n for n, ip in IFACES if ip == "127.0.0.1")
OTHER = next(((n, ip) for n, ip in IFACES if "." in ip and not ip.startswith("127.")), None)


def test_interfaces_lists_loopback_with_its_address():
    assert (LO, "127.0.0.1") in IFACES and all(isinstance(n, str) and ip for n, ip in IFACES)


@pytest.mark.parametrize("var", ["PZ_IFACE", "PZ_FABRIC_IFACE", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"])
def test_each_setting_names_the_interface_and_a_bad_name_says_which_setting(var):
    got = address.candidate(Settings.from_env({var: LO}))
    assert got.ip == "127.0.0.1" and got.why.startswith(f"{var}={LO}"), got
    with pytest.raises(ValueError, match=f"{var}='pz-nope0': no such network interface on this host .it has: .*{LO}"):
        address.candidate(Settings.from_env({var: "pz-nope0"}))


def test_pz_iface_wins_over_torch_settings_and_gloo_over_nccl():
    env = {"PZ_IFACE": LO, "GLOO_SOCKET_IFNAME": "pz-nope0"}
    assert address.candidate(Settings.from_env(env)).why.startswith("PZ_IFACE")
    env = {"GLOO_SOCKET_IFNAME": f"{LO},pz-nope1", "NCCL_SOCKET_IFNAME": "pz-nope0"}
    got = address.candidate(Settings.from_env(env))
    assert got.ip == "127.0.0.1" and got.why.startswith("GLOO_SOCKET_IFNAME"), got


def test_nccl_rules_prefix_exact_and_exclusion():
    pre = address.candidate(Settings.from_env({"NCCL_SOCKET_IFNAME": LO[:1]}))
    assert pre.ip and pre.why.startswith("NCCL_SOCKET_IFNAME"), pre
    with pytest.raises(ValueError, match="NCCL_SOCKET_IFNAME"):
        address.candidate(Settings.from_env({"NCCL_SOCKET_IFNAME": f"={LO[:1]}x-nope"}))
    # An exclusion list names no interface: the next rule (the route to MASTER_ADDR) decides.
    got = address.candidate(Settings.from_env({"NCCL_SOCKET_IFNAME": "^docker", "MASTER_ADDR": "127.0.0.1"}))
    assert got.why == "the route to MASTER_ADDR 127.0.0.1" and got.ip == "", got


def test_one_host_listens_on_loopback_whatever_the_candidate():
    for mine in (Listen("", "x"), Listen("10.0.0.5", "PZ_IFACE=eth9")):
        assert address.choose(mine, ["a", "a"], ["", ""], 0).ip == "127.0.0.1"


def test_never_loopback_across_hosts():
    with pytest.raises(ValueError, match="GLOO_SOCKET_IFNAME=lo is a loopback address .127.0.0.1., but ranks run on "
                                         "2 hosts: set PZ_IFACE"):
        address.choose(Listen("127.0.0.1", "GLOO_SOCKET_IFNAME=lo"), ["a", "b"], ["127.0.0.1", "10.0.0.2"], 0)
    # No candidate, and no rank elsewhere with one either: a clear error, not a loopback bind.
    with pytest.raises(ValueError, match="no address of this host reaches the job's other hosts"):
        address.choose(Listen("", "the route to MASTER_ADDR node0"), ["a", "b"], ["", ""], 0)


@pytest.mark.skipif(OTHER is None, reason="this host has no non-loopback IPv4 address")
def test_the_masters_host_routes_to_a_rank_elsewhere():
    """Rank 0's route to MASTER_ADDR is loopback (its own name at 127.0.1.1);
    rank 1, on another host, published its address: rank 0 takes the route there."""
    name, ip = OTHER
    got = address.choose(Listen("", "the route to MASTER_ADDR node0"), ["node0", "node1"], ["", ip], 0)
    assert got.ip == ip and f"route to rank 1's address {ip}" in got.why, got
    got = address.candidate(Settings.from_env({"MASTER_ADDR": ip}))
    assert got.ip == ip and got.why == f"the route to MASTER_ADDR {ip}", got


def test_route_to_a_name_that_does_not_resolve_is_empty():
    assert address.route_to("pz-no-such-host.invalid") == ""


@pytest.mark.parametrize("bad", ["1-", "abc", "2000-1000", "80-90", "60000-70000"])
def test_port_range_is_parsed_and_checked(bad):
    assert Settings.from_env({"PZ_PORT_RANGE": "29600-29610"}).port_range == (29600, 29610)
    assert Settings.from_env({}).port_range is None
    with pytest.raises(ValueError, match="PZ_PORT_RANGE must be LO-HI"):
        Settings.from_env({"PZ_PORT_RANGE": bad})


def _free_range(n: int) -> tuple:
    """n consecutive ports free now on loopback (the kernel's ephemeral range is elsewhere)."""
    for lo in range(31000, 32000, n):
        socks = []
        try:
            for p in range(lo, lo + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return lo, lo + n - 1
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    pytest.skip("no free port range")


def test_watch_listens_inside_the_range_and_says_when_it_is_full():
    lo, hi = _free_range(3)
    ws = [_C.LivenessWatch(0, [0, 1], os.urandom(16), 4.0, "127.0.0.1", "", lo, hi) for _ in range(3)]
    try:
        ports = sorted(int(w.address().split()[1]) for w in ws)
        assert ports == [lo, lo + 1, lo + 2], ports
        with pytest.raises(RuntimeError, match=f"every port of PZ_PORT_RANGE {lo}-{hi} is in use"):
            _C.LivenessWatch(0, [0, 1], os.urandom(16), 4.0, "127.0.0.1", "", lo, hi)
    finally:
        for w in ws:
            w.close()


@pytest.mark.skipif(not _C.has_fabric or bool(_C.fabric_probe()), reason="no fabric engine here")
def test_fabric_endpoints_listen_inside_the_range():
    """In a fresh process (libfabric reads its port range once): the rails' ports lie in PZ_PORT_RANGE."""
    lo, hi = _free_range(8)
    code = textwrap.dedent(f"""
        import os, socket, struct, torch
        from types import SimpleNamespace
        from portable_zip.comm.transports.fabric import FabricTransport
        from portable_zip.comm.settings import Settings
        g = SimpleNamespace(rank=0, size=2, ranks=[0, 1], secret=os.urandom(16))
        s = Settings.from_env({{"PZ_FABRIC_PROVIDER": "tcp;ofi_rxm", "PZ_FABRIC_RAILS": "2", "PZ_PORT_RANGE": "{lo}-{hi}"}})
        tp = FabricTransport(g, torch.device("cpu"), s, same_host=True)
        a = tp.engine.address()
        rails, chunk, depth, nlen = struct.unpack_from("<IQII", a, 36)
        names = [a[56 + r * nlen:56 + (r + 1) * nlen] for r in range(rails)]
        print(" ".join(str(struct.unpack_from(">H", n, 2)[0]) for n in names))
        tp.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("FI_TCP_PORT")})
    assert out.returncode == 0, out.stderr
    ports = [int(p) for p in out.stdout.split()]
    assert len(ports) == 2 and all(lo <= p <= hi for p in ports), (ports, lo, hi)
