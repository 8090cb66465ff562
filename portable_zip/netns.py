"""Hosts on one machine: network namespaces joined by a bridge, every host's
link shaped with tc, and a command run once per rank inside them, so the
codec's pay-off over a network shows on any Linux machine (root, iproute2).

    ci/netns run [--hosts 2] [--per-host 1] [--gbit 5] [--delay-us 50] [--timeout 600] -- CMD ARG...
    ci/netns measure [--gbit 5] [--delay-us 50] [--seconds 2]
    (python -I portable_zip/netns.py ... is the same; PZ_NETNS_GBIT, PZ_NETNS_DELAY_US set the defaults.)

From Python: `with Link(hosts=2, gbit=1) as link: link.measure(); link.run([...], per_host=2)`.

Layout: namespace pznet<pid>x<random>-<n>-hub holds a bridge (n counts this
process's links); host i is namespace pznet<pid>x<random>-<n>-<i> with loopback and one veth, `pzlink`, at 10.213.0.<i+1>/24,
whose peer is a bridge port. tbf limits both directions of every host's link
(the host's egress and the bridge port's egress toward it), so any two hosts
meet at the rate, and N-to-1 traffic shares the receiver's rate as it would at
a switch. netem adds the one-way delay on each host's egress where the kernel
has it (else the delay is left out, said once). measure() moves bytes with
plain TCP sockets from host 0 to host 1: the limit benchmarks compare against.

Each rank's process runs in its host's namespace in a UTS namespace of its
own named pz-host-<i> (so domains="host" sees hosts), with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (host 0), MASTER_PORT (torch's env://
init), GLOO_SOCKET_IFNAME, FI_TCP_IFACE and FI_SOCKETS_IFACE (gloo and libfabric
bind to pzlink, not loopback), PZ_NETNS_HOST and PZ_NETNS_ADDRS. Output lines
come back prefixed with the rank. Every wait is bounded; the namespaces and
every process started in them are removed on exit, signals included.

Standard library only: ci/netns runs this file with any Python 3.10+."""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

IFNAME = "pzlink"
SUBNET = "10.213.0"  # inside the namespaces only: no host route can collide
PORT = 29513
PREFIX = "pznet"
MTU = 9000  # jumbo frames, as cluster networks run: a sixth of the packets to shape per byte
MAX_HOSTS = 64
ETC = "/etc/netns"  # ip netns exec mounts ETC/<ns>/hosts over /etc/hosts
LOCKS = "/run/pznet"  # a run holds LOCKS/<tag>.lock (flock) while its namespaces live
_MARK = "PZ_NETNS_RESULT "  # a probe's result line
_links = itertools.count()  # a process may build links one after another, or at once


class LinkError(RuntimeError):
    """The link cannot be built here (why in the message)."""


def unavailable() -> str:
    """"" when this machine can build a link, else why not (one line)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    if not _capable():
        return ("root here lacks CAP_SYS_ADMIN or CAP_NET_ADMIN; in a container, run it with --privileged "
                "or --cap-add SYS_ADMIN --cap-add NET_ADMIN")
    missing = [t for t in ("ip", "tc", "unshare", "hostname") if not shutil.which(t)]
    if missing:
        return f"{', '.join(missing)} not found (apt install iproute2 util-linux hostname)"
    return ""


def _capable() -> bool:
    """CAP_SYS_ADMIN (bit 21: namespaces, their mounts) and CAP_NET_ADMIN (bit 12: links, tc) in effect."""
    try:
        with open("/proc/self/status") as f:
            eff = next(int(l.split()[1], 16) for l in f if l.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return True  # unknown: let ip say what fails
    return eff & (1 << 21) != 0 and eff & (1 << 12) != 0


def env_float(name: str, default: float) -> float:
    """A PZ_NETNS_* number from the environment, or a clear ValueError."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name} must be a number, got {os.environ[name]!r}") from None


def _sh(*args: str, timeout: float = 20.0) -> str:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LinkError(f"'{' '.join(args)}' took over {timeout:g} s") from None
    if p.returncode:
        raise LinkError(f"'{' '.join(args)}' failed: {(p.stderr or p.stdout).strip()}")
    return p.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _lock_path(tag: str) -> str:
    return os.path.join(LOCKS, tag + ".lock")


def _owned(tag: str) -> bool:
    """Whether a live process holds tag's lock. A lock, not a pid: a run in
    another PID namespace has pids this one cannot see (or shares its own),
    but the kernel drops a dead process's flock wherever it ran."""
    try:
        fd = os.open(_lock_path(tag), os.O_RDWR)
    except FileNotFoundError:
        return False  # a run takes its lock before it makes a namespace: none left means none owns it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _remove_stale() -> None:
    """Namespaces (and lock files) left by a run whose process is gone (killed with SIGKILL)."""
    tags = {}
    for line in _sh("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX) and "-" in name:
            tags.setdefault(name.rsplit("-", 1)[0], []).append(name)
    for tag, names in tags.items():
        pid = tag[len(PREFIX):].split("-")[0]
        if pid.isdigit() and _alive(int(pid)):  # an older version's run, which takes no lock: its pid in our view
            continue
        if not _owned(tag):
            for ns in names:
                _delete(ns)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_lock_path(tag))


def _delete(ns: str) -> None:
    """Kill what still runs in ns (by pid: escaped process groups too), then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
    shutil.rmtree(os.path.join(ETC, ns), ignore_errors=True)


def _tbf(ns: str, dev: str, bits: int, parent: Sequence[str]) -> None:
    """A token bucket of `bits`/s: a burst of 100 us at the rate (64 KiB at
    least: a GSO packet) and a queue of 8 ms (4 MiB at least), deeper than
    TCP's per-socket queue (tcp_limit_output_bytes), so TCP is paced by the
    qdisc's backpressure, not by drops."""
    burst = max(64 << 10, bits // 8 // 10_000)
    limit = max(4 << 20, bits // 8 // 125)
    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{bits}bit",
        "burst", str(burst), "limit", str(limit))


class Link:
    """hosts namespaces behind a bridge, each link limited to gbit Gbit/s
    both ways with delay_us of one-way delay. A context manager: up() on
    entry, down() on exit."""

    def __init__(self, hosts: int = 2, gbit: Optional[float] = None, delay_us: Optional[float] = None,
                 debian_hosts: bool = False):
        """debian_hosts: each host's /etc/hosts maps its own name to 127.0.1.1,
        as Debian's and Ubuntu's installers write it (the others' names stand
        in for DNS); else every name maps to its link address."""
        self.gbit = float(gbit if gbit is not None else env_float("PZ_NETNS_GBIT", 5))
        self.delay_us = float(delay_us if delay_us is not None else env_float("PZ_NETNS_DELAY_US", 50))
        if not 2 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be 2 to {MAX_HOSTS}, got {hosts}")
        if not 0.001 <= self.gbit <= 400:
            raise ValueError(f"the rate must be 0.001 to 400 Gbit/s, got {self.gbit:g}")
        if not 0 <= self.delay_us <= 1e6:
            raise ValueError(f"the delay must be 0 to 1e6 us, got {self.delay_us:g}")
        self.hosts = hosts
        self.debian_hosts = debian_hosts
        # Random as well as the pid: runs in PID namespaces can share a pid.
        tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-{next(_links)}"
        self.tag = tag
        self._lock = -1  # the fd whose flock says this run is alive (_owned)
        self.hub = f"{tag}-hub"
        self.names = [f"{tag}-{i}" for i in range(hosts)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.note = ""  # what the link leaves out (netem missing)
        self._made: List[str] = []
        self._procs: List[subprocess.Popen] = []

    def __enter__(self) -> "Link":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def describe(self) -> str:
        delay = self.note or f"{self.delay_us:g} us one-way delay"
        return f"{self.hosts} hosts (network namespaces), {self.gbit:g} Gbit/s per host link, {delay}"

    def up(self) -> None:
        why = unavailable()
        if why:
            raise LinkError(why)
        _remove_stale()
        os.makedirs(LOCKS, exist_ok=True)
        self._lock = os.open(_lock_path(self.tag), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        bits = int(self.gbit * 1e9)
        # Every host's address resolves to its name, IPv4-mapped too (c10d's
        # store sees its clients as ::ffff:a.b.c.d and looks them up).
        def hosts_file(me: int) -> str:
            names = [("127.0.0.1", "localhost"), ("::1", "localhost")] + \
                [("127.0.1.1" if i == me and self.debian_hosts else a, f"pz-host-{i}") for i, a in enumerate(self.addrs)]
            return "".join(f"{a} {n}\n" for a, n in names) + \
                "".join(f"::ffff:{a} {n}\n" for a, n in names if "." in a)
        try:
            for i, ns in enumerate([self.hub, *self.names]):
                _sh("ip", "netns", "add", ns)
                self._made.append(ns)
                os.makedirs(os.path.join(ETC, ns), exist_ok=True)
                with open(os.path.join(ETC, ns, "hosts"), "w") as f:
                    f.write(hosts_file(i - 1))
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            for i, (ns, addr) in enumerate(zip(self.names, self.addrs)):
                port = f"port{i}"
                _sh("ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
                _sh("ip", "-n", self.hub, "link", "set", port, "master", "br0")
                _sh("ip", "-n", self.hub, "link", "set", port, "mtu", str(MTU), "up")
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
                _sh("ip", "-n", ns, "link", "set", IFNAME, "mtu", str(MTU), "up")
                _tbf(self.hub, port, bits, ["root"])  # toward host i: its receive side
                parent = ["root"]
                if self.delay_us and not self.note:
                    try:
                        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, "root", "handle", "1:",
                            "netem", "delay", f"{self.delay_us:g}us", "limit", "100000")
                        parent = ["parent", "1:1"]
                    except LinkError as e:
                        why = "this kernel has no netem qdisc" if "unknown" in str(e) else str(e)
                        self.note = f"no added delay ({why})"
                _tbf(ns, IFNAME, bits, parent)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Every process started here, then every namespace (their veths go with them)."""
        self._kill(self._procs)
        self._procs = []
        for ns in reversed(self._made):
            _delete(ns)
        self._made = []
        if self._lock >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_lock_path(self.tag))
            os.close(self._lock)
            self._lock = -1

    @staticmethod
    def _kill(procs: List[subprocess.Popen]) -> None:
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            live = [p for p in procs if p.poll() is None]
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + grace
            while any(p.poll() is None for p in live) and time.monotonic() < end:
                time.sleep(0.05)

    def env(self, host: int, local: int, per_host: int, port: int = PORT) -> Dict[str, str]:
        return {"RANK": str(host * per_host + local), "WORLD_SIZE": str(self.hosts * per_host),
                "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(per_host), "MASTER_ADDR": self.addrs[0],
                "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": IFNAME, "FI_TCP_IFACE": IFNAME,
                "FI_SOCKETS_IFACE": IFNAME, "PZ_NETNS_HOST": str(host), "PZ_NETNS_ADDRS": ",".join(self.addrs)}

    def run(self, cmd: Sequence[str], per_host: int = 1, timeout: float = 600.0, grace: float = 15.0,
            env: Optional[Dict[str, str]] = None, echo: bool = True) -> "Ranks":
        """cmd once per rank (rank = host * per_host + local), all started at
        once; returns when all have exited, or kills them all at timeout, or
        grace seconds after one fails (the others would wait on it)."""
        if not self._made:
            raise LinkError("the link is not up")
        if not 1 <= per_host <= 64:
            raise ValueError(f"per_host must be 1 to 64, got {per_host}")
        ranks = Ranks(echo)
        for h, ns in enumerate(self.names):
            for local in range(per_host):
                e = {**os.environ, **(env or {}), **self.env(h, local, per_host)}
                argv = ["ip", "netns", "exec", ns, "unshare", "--uts", "--", "sh", "-c",
                        'hostname "$0" && exec "$@"', f"pz-host-{h}", *cmd]
                p = subprocess.Popen(argv, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
                self._procs.append(p)
                ranks.add(p)
        ranks.wait(timeout, grace)
        self._kill(ranks.procs)
        return ranks

    def measure(self, seconds: float = 2.0, max_bytes: Optional[int] = None, timeout: float = 60.0) -> dict:
        """The link's real limit with plain TCP from host 0 to host 1:
        {"gbit": received bits / s, "rtt_us": median 1-byte round trip, ...}.
        Bounded: seconds of sending or max_bytes (default twice what the rate
        allows), whichever ends first."""
        if not 0.1 <= seconds <= 60:
            raise ValueError(f"seconds must be 0.1 to 60, got {seconds:g}")
        limit = max_bytes or int(self.gbit * 1e9 / 8 * seconds * 2)
        probe = [sys.executable, "-I", os.path.abspath(__file__), "_probe", str(seconds), str(limit)]
        ranks = self.run(probe, timeout=timeout, echo=False)
        if any(ranks.codes):
            raise LinkError("the link probe failed:\n" + "\n".join(ranks.lines))
        got = {k: v for r in ranks.results() for k, v in r.items()}
        return {"gbit": got["bytes"] * 8 / got["seconds"] / 1e9, "rtt_us": got["rtt_us"], "bytes": got["bytes"],
                "seconds": got["seconds"], "configured_gbit": self.gbit, "delay_us": 0 if self.note else self.delay_us}


class Ranks:
    """The processes of one run: their output (prefixed lines) and exit codes."""

    def __init__(self, echo: bool):
        self.procs: List[subprocess.Popen] = []
        self.lines: List[str] = []  # every rank's, prefixed, as they came
        self.out: List[List[str]] = []  # each rank's own
        self._echo = echo
        self._threads: List[threading.Thread] = []
        self._lock = threading.Lock()
        self.late: List[bool] = []  # still running at the timeout

    def add(self, p: subprocess.Popen) -> None:
        rank = len(self.procs)
        self.procs.append(p)
        self.out.append([])
        t = threading.Thread(target=self._read, args=(rank, p), daemon=True)
        t.start()
        self._threads.append(t)

    def _read(self, rank: int, p: subprocess.Popen) -> None:
        for raw in p.stdout:  # what a terminal would show of the line: progress bars redraw after \r
            text = raw.decode(errors="replace").rstrip().rsplit("\r", 1)[-1]
            line = f"[rank {rank}] {text}"
            with self._lock:
                self.out[rank].append(text)
                self.lines.append(line)
                if self._echo and not text.startswith(_MARK):  # results are returned, not shown
                    print(line, flush=True)

    def wait(self, timeout: float, grace: float) -> None:
        end = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() > end:
                self.late = [p.poll() is None for p in self.procs]
                return
            if any(p.poll() not in (None, 0) for p in self.procs):
                end = min(end, time.monotonic() + grace)
            time.sleep(0.05)
        for t in self._threads:
            t.join(5.0)

    @property
    def timed_out(self) -> bool:
        return any(self.late)

    @property
    def codes(self) -> List[Optional[int]]:
        """Exit codes in rank order; 124 for a rank killed at the timeout."""
        late = self.late or [False] * len(self.procs)
        return [124 if t else p.returncode for p, t in zip(self.procs, late)]

    def results(self) -> List[dict]:
        """The JSON each rank printed after _MARK, in rank order."""
        return [json.loads(l[len(_MARK):]) for out in self.out for l in out if l.startswith(_MARK)]


def report(result: dict) -> None:
    """A rank's result, for Ranks.results() in the process that ran it."""
    print(_MARK + json.dumps(result), flush=True)


def _probe(seconds: float, limit: int) -> None:
    """Host 1 listens; host 0 times 200 one-byte round trips, then sends for
    `seconds` or `limit` bytes; host 1 reports what arrived and how fast."""
    host = int(os.environ["PZ_NETNS_HOST"])
    addrs = os.environ["PZ_NETNS_ADDRS"].split(",")
    port = int(os.environ["MASTER_PORT"]) + 1
    if host == 1:
        with socket.create_server((addrs[1], port)) as srv:
            srv.settimeout(30)
            conn, _ = srv.accept()
        with conn:
            conn.settimeout(30)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(200):
                conn.sendall(conn.recv(1))
            buf, n, t0 = bytearray(4 << 20), 0, None
            while True:
                k = conn.recv_into(buf)
                if not k:
                    break
                t0 = t0 or time.perf_counter()
                n += k
            report({"bytes": n, "seconds": time.perf_counter() - (t0 or 0)})
        return
    if host != 0:
        return
    end = time.monotonic() + 30
    while True:  # host 1 may not listen yet
        try:
            conn = socket.create_connection((addrs[1], port), timeout=5)
            break
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
    with conn:
        conn.settimeout(30)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(200):
            t = time.perf_counter()
            conn.sendall(b"x")
            if conn.recv(1) != b"x":
                raise ConnectionError("the probe's echo broke")
            rtts.append(time.perf_counter() - t)
        data, sent, stop = memoryview(bytearray(1 << 20)), 0, time.monotonic() + seconds
        while sent < limit and time.monotonic() < stop:
            conn.sendall(data[:min(len(data), limit - sent)])
            sent += min(len(data), limit - sent)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # host 1 closes once it has counted everything
    report({"rtt_us": sorted(rtts)[len(rtts) // 2] * 1e6})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ci/netns", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "measure"):
        s = sub.add_parser(name)
        s.add_argument("--gbit", type=float, default=None, help="per-host link rate (PZ_NETNS_GBIT, default 5)")
        s.add_argument("--delay-us", type=float, default=None, help="one-way delay (PZ_NETNS_DELAY_US, default 50)")
        s.add_argument("--hosts", type=int, default=2)
        if name == "run":
            s.add_argument("--per-host", type=int, default=1, help="ranks per namespace")
            s.add_argument("--timeout", type=float, default=600.0, help="seconds before every rank is killed")
            s.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARG...")
        else:
            s.add_argument("--seconds", type=float, default=2.0)
    pr = sub.add_parser("_probe")
    pr.add_argument("seconds", type=float)
    pr.add_argument("limit", type=int)
    a = p.parse_args(argv)
    if a.cmd == "_probe":
        _probe(a.seconds, a.limit)
        return 0
    cmd = a.command[1:] if a.cmd == "run" and a.command[:1] == ["--"] else getattr(a, "command", None)
    if a.cmd == "run" and not cmd:
        p.error("run needs a command after --")
    try:
        with Link(a.hosts, a.gbit, a.delay_us) as link:
            print(f"ci/netns: {link.describe()}", flush=True)
            if a.cmd == "measure":
                print(json.dumps(link.measure(a.seconds)), flush=True)
                return 0
            ranks = link.run(cmd, a.per_host, a.timeout)
            codes = ranks.codes
            if ranks.timed_out:
                print(f"ci/netns: ranks still running after {a.timeout:g} s were killed", file=sys.stderr)
            return next((c for c in codes if c), 0)
    except (LinkError, ValueError) as e:
        print(f"ci/netns: {e}", file=sys.stderr)
        return 2


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP raise SystemExit in the main thread, so a Link's
    with-block unwinds and removes what it made (SIGINT already does)."""
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _exit_on_signal)


if __name__ == "__main__":
    exit_on_signals()
    sys.exit(main())
