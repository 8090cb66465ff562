"""Every PZ_* variable the Python package reads, read in one place.

A Communicator reads them once, at construction (Settings.from_env()), and
carries the result down to every exchange: a forked rank that sets its
environment after import still gets its own values, and nothing below the
Communicator reads os.environ. docs/SETTINGS.md lists these beside the
build-time variables and the three the C++ library reads itself
(PZ_GPU_LIBRARY, PZ_FABRIC_LIBRARY, PZ_CPU_SIMD)."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping, Optional

WAVE_BYTES = 32 << 20
# torch's own interface settings, in the order a listener follows them (after PZ_IFACE).
TORCH_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")  # each wave costs ~0.2-0.5 ms of host work (PZ_TRACE): few, large waves


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    v = env.get(name)
    try:
        return int(v) if v else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {v!r}") from None


def _float(env: Mapping[str, str], name: str) -> Optional[float]:
    v = env.get(name)
    try:
        return float(v) if v else None
    except ValueError:
        raise ValueError(f"{name} must be a number, got {v!r}") from None


def _port_range(v: str) -> Optional[tuple]:
    """PZ_PORT_RANGE "LO-HI" (inclusive), or None."""
    if not v:
        return None
    try:
        lo, hi = (int(x) for x in v.split("-"))
    except ValueError:
        raise ValueError(f"PZ_PORT_RANGE must be LO-HI (e.g. 29600-29700), got {v!r}") from None
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"PZ_PORT_RANGE must be LO-HI with 1024 <= LO <= HI <= 65535, got {v!r}")
    return lo, hi


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "0") not in ("", "0")


@dataclass(frozen=True)
class Settings:
    timeout: Optional[str] = None    # PZ_TIMEOUT: an op's deadline in seconds (the Communicator parses it, as timeout=)
    check_plans: bool = False        # PZ_CHECK_PLANS=1: swap a hash of every op's plan and specs
    sync_native: bool = False        # PZ_SYNC_NATIVE=1: native NCCL plans wait on the host, bounded by timeout
    trace: bool = False              # PZ_TRACE=1: print each exchange's host timeline to stderr
    piece_bytes: int = 0             # PZ_PIECE_BYTES: bytes per pipelined piece (0: by size); same on every rank
    wave_bytes: int = WAVE_BYTES     # PZ_WAVE_BYTES: bytes per wave of an exchange; same on every rank
    max_sms: Optional[int] = None    # PZ_MAX_SMS: default SM budget of a Communicator's codec launches
    link_gbps: Optional[float] = None        # PZ_LINK_GBPS: policy override
    link_latency_us: Optional[float] = None  # PZ_LINK_LATENCY_US
    codec_gbps: Optional[float] = None       # PZ_CODEC_GBPS
    policy_margin: Optional[float] = None    # PZ_POLICY_MARGIN (default 0.05)
    stats: bool = False              # PZ_STATS=1: each pz group prints what it moved (pz.stats) at destroy_process_group
    heartbeat_timeout: Optional[float] = None  # PZ_HEARTBEAT_TIMEOUT: seconds of a peer's silence that mean it is dead (4)
    # The fabric's, as given: parsed by fabric() when a fabric is made, so a
    # bad value never breaks a Communicator that does not use it.
    fabric_provider: str = ""        # PZ_FABRIC_PROVIDER: force one ("tcp;ofi_rxm", "efa", "shm", ...)
    fabric_rails: str = ""           # PZ_FABRIC_RAILS: endpoints per peer (1 under push, else 2)
    fabric_chunk: str = ""           # PZ_FABRIC_CHUNK: bytes per chunk and staging slot (256 KiB under push, else 2 MiB)
    fabric_depth: str = ""           # PZ_FABRIC_DEPTH: chunks in flight per peer and direction (max(4, 2 x rails))
    fabric_stage: bool = False       # PZ_FABRIC_STAGE=1: stage host memory too
    fabric_spin: str = ""            # PZ_FABRIC_SPIN: idle polls before the progress thread sleeps (2000)
    fabric_window: str = ""          # PZ_FABRIC_WINDOW: push window in bytes over tcp;ofi_rxm (4 MiB; 0: rendezvous)
    # Where listeners bind (comm/address.py): PZ_IFACE (alias PZ_FABRIC_IFACE), else torch's
    # *_SOCKET_IFNAME, else the route to MASTER_ADDR; loopback when every rank is on one host.
    iface: str = ""                  # PZ_IFACE
    port_range: Optional[tuple] = None  # PZ_PORT_RANGE "LO-HI": the TCP ports listeners take (default: the kernel's)
    iface_var: str = "PZ_IFACE"      # which variable named iface (PZ_FABRIC_IFACE is the old name)
    torch_ifnames: tuple = ()        # ((variable, value), ...) of torch's GLOO/NCCL/TP_SOCKET_IFNAME that are set
    master_addr: str = ""            # MASTER_ADDR (torchrun's, env://): whose route picks the interface

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Settings":
        env = os.environ if env is None else env
        s = cls(
            timeout=env.get("PZ_TIMEOUT") or None,
            check_plans=_flag(env, "PZ_CHECK_PLANS"),
            sync_native=env.get("PZ_SYNC_NATIVE", "0") == "1",
            trace=_flag(env, "PZ_TRACE"),
            piece_bytes=_int(env, "PZ_PIECE_BYTES", 0),
            wave_bytes=_int(env, "PZ_WAVE_BYTES", WAVE_BYTES),
            max_sms=_int(env, "PZ_MAX_SMS", 0) or None,
            link_gbps=_float(env, "PZ_LINK_GBPS"),
            link_latency_us=_float(env, "PZ_LINK_LATENCY_US"),
            codec_gbps=_float(env, "PZ_CODEC_GBPS"),
            policy_margin=_float(env, "PZ_POLICY_MARGIN"),
            stats=_flag(env, "PZ_STATS"),
            heartbeat_timeout=_float(env, "PZ_HEARTBEAT_TIMEOUT"),
            fabric_provider=env.get("PZ_FABRIC_PROVIDER", ""),
            fabric_rails=env.get("PZ_FABRIC_RAILS", ""),
            fabric_chunk=env.get("PZ_FABRIC_CHUNK", ""),
            fabric_depth=env.get("PZ_FABRIC_DEPTH", ""),
            fabric_stage=env.get("PZ_FABRIC_STAGE") == "1",
            fabric_spin=env.get("PZ_FABRIC_SPIN", ""),
            fabric_window=env.get("PZ_FABRIC_WINDOW", ""),
            iface=env.get("PZ_IFACE") or env.get("PZ_FABRIC_IFACE", ""),
            iface_var="PZ_FABRIC_IFACE" if env.get("PZ_FABRIC_IFACE") and not env.get("PZ_IFACE") else "PZ_IFACE",
            port_range=_port_range(env.get("PZ_PORT_RANGE", "")),
            torch_ifnames=tuple((v, env[v]) for v in TORCH_IFNAMES if env.get(v)),
            master_addr=env.get("MASTER_ADDR", ""),
        )
        if s.piece_bytes < 0 or s.wave_bytes < 1:
            raise ValueError(f"PZ_PIECE_BYTES must be >= 0 and PZ_WAVE_BYTES >= 1, got {s.piece_bytes}, "
                             f"{s.wave_bytes}")
        if s.heartbeat_timeout is not None and not 0 < s.heartbeat_timeout < float("inf"):
            raise ValueError(f"PZ_HEARTBEAT_TIMEOUT must be a positive number of seconds, got {s.heartbeat_timeout}")
        if s.max_sms is not None and s.max_sms < 1:
            raise ValueError(f"PZ_MAX_SMS must be >= 1, got {s.max_sms}")
        return s

    def fabric(self) -> tuple:
        """(provider, rails, chunk, depth, stage, spin, window) for the engine; 0 for rails,
        chunk and depth (-1 for window) leaves the choice to the engine, made
        for the provider it finds. ValueError names a bad variable."""
        env = {"PZ_FABRIC_RAILS": self.fabric_rails, "PZ_FABRIC_CHUNK": self.fabric_chunk,
               "PZ_FABRIC_DEPTH": self.fabric_depth, "PZ_FABRIC_SPIN": self.fabric_spin,
               "PZ_FABRIC_WINDOW": self.fabric_window}
        for name in ("PZ_FABRIC_RAILS", "PZ_FABRIC_CHUNK", "PZ_FABRIC_DEPTH"):  # 0 is the engine's "its default"
            if env[name] and _int(env, name, 0) < 1:
                raise ValueError(f"{name} must be a positive integer, got {env[name]!r}")
        return (self.fabric_provider, _int(env, "PZ_FABRIC_RAILS", 0), _int(env, "PZ_FABRIC_CHUNK", 0),
                _int(env, "PZ_FABRIC_DEPTH", 0), self.fabric_stage, _int(env, "PZ_FABRIC_SPIN", 2000),
                _int(env, "PZ_FABRIC_WINDOW", -1))


# field -> its variable (docs/SETTINGS.md lists each; a test checks). The
# rest record which variable was read, or torch's own.
_NOT_PZ = {"iface_var", "torch_ifnames", "master_addr"}
NAMES = {f.name: "PZ_" + f.name.upper() for f in fields(Settings) if f.name not in _NOT_PZ}
