"""Where this rank listens (the liveness watch, the fabric's endpoints): an
address the job's peers can reach, chosen the same way for every listener.

In order:
1. PZ_IFACE (its old name PZ_FABRIC_IFACE): that interface's address;
2. torch's own settings, GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME (NCCL's
   prefix rules) and TP_SOCKET_IFNAME: the job already told torch where;
3. the interface that routes to MASTER_ADDR (else the store's host). On the
   master's own host that route is loopback (Debian and Ubuntu map the
   hostname to 127.0.1.1), so those ranks take the route to a rank on
   another host instead.
Every rank on one host: loopback. Otherwise never loopback."""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import portable_zip._C as _C
from .settings import Settings

SETTINGS_HINT = "set PZ_IFACE (or GLOO_SOCKET_IFNAME) on every host to the interface its peers reach it through"


@dataclass(frozen=True)
class Listen:
    ip: str    # numeric; "" on one host until resolved
    why: str   # the setting or rule that picked it, for errors


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def _v4_first(ips: Sequence[str]) -> str:
    return sorted(ips, key=lambda ip: ":" in ip)[0]


def iface_ip(name: str, var: str, prefix: bool = False) -> Tuple[str, str]:
    """(address, interface) of interface `name` (prefix: the first whose name
    starts with it, NCCL's rule), IPv4 first; ValueError names var."""
    pairs: List[Tuple[str, str]] = _C.interfaces()
    names = list(dict.fromkeys([n for _, n in socket.if_nameindex()] + [n for n, _ in pairs]))
    for n in names:
        ips = [ip for m, ip in pairs if m == n]
        if ips and (n.startswith(name) if prefix else n == name):
            return _v4_first(ips), n
    if not prefix and name in names:
        raise ValueError(f"{var}='{name}': the interface has no IP address")
    raise ValueError(f"{var}='{name}': no such network interface on this host (it has: {', '.join(names)})")


def _torch_iface(var: str, value: str) -> Optional[Tuple[str, str]]:
    """(address, interface) torch's variable names, None where it only excludes (NCCL's ^)."""
    first = value.split(",")[0].strip()
    if var == "NCCL_SOCKET_IFNAME":
        if first.startswith("^"):
            return None
        if first.startswith("="):
            return iface_ip(first[1:], var)
        return iface_ip(first, var, prefix=True)
    return iface_ip(first, var)


def route_to(host: str) -> str:
    """This host's address on the route to host ("" if it does not resolve or
    no route): a UDP socket's connect() picks it, and sends nothing."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return ""
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(addr)
                return s.getsockname()[0]
        except OSError:
            continue
    return ""


def store_host(store) -> str:
    """The host of the TCPStore under store's prefixes, "" if none."""
    for _ in range(8):
        host = getattr(store, "host", None)
        if isinstance(host, str):
            return host
        store = getattr(store, "underlying_store", None)
        if store is None:
            return ""
    return ""


def candidate(settings: Settings, store=None) -> Listen:
    """What this rank can tell alone: a named interface's address, else the
    route to the master ("" when that route is loopback: see choose())."""
    if settings.iface:
        ip, _ = iface_ip(settings.iface, settings.iface_var)
        return Listen(ip, f"{settings.iface_var}={settings.iface}")
    for var, value in settings.torch_ifnames:
        got = _torch_iface(var, value)
        if got:
            return Listen(got[0], f"{var}={value} (interface {got[1]})")
    master, what = settings.master_addr, "MASTER_ADDR"
    if not master and store is not None:
        master, what = store_host(store), "the store's host"
    ip = route_to(master) if master else ""
    if ip and not is_loopback(ip):
        return Listen(ip, f"the route to {what} {master}")
    return Listen("", f"the route to {what} {master}" if master else "no MASTER_ADDR")


def choose(mine: Listen, hosts: Sequence[str], addrs: Sequence[str], rank: int) -> Listen:
    """Where this rank listens, from its candidate and every rank's host and
    candidate address (facts swapped through the store)."""
    if len(set(hosts)) == 1:
        return Listen("127.0.0.1", "every rank on one host")
    if mine.ip and is_loopback(mine.ip):
        raise ValueError(f"{mine.why} is a loopback address ({mine.ip}), but ranks run on "
                         f"{len(set(hosts))} hosts: {SETTINGS_HINT}")
    if mine.ip:
        return mine
    for j, (h, a) in enumerate(zip(hosts, addrs)):  # on the master's host: route to a rank elsewhere
        if h != hosts[rank] and a and not is_loopback(a):
            ip = route_to(a)
            if ip and not is_loopback(ip):
                return Listen(ip, f"the route to rank {j}'s address {a} ({mine.why} is loopback here)")
    raise ValueError(f"no address of this host reaches the job's other hosts ({mine.why} gives none): "
                     f"{SETTINGS_HINT}")
