"""Mixed clusters: ranks that share a vendor and a native fast path form a
domain; data moves natively inside a domain and over the fabric engine,
compressed where it pays, between domains (transports/routed.py).

Every rank publishes what it is (device kind, host, build) through the job's
store at construction, so all ranks derive the same domains."""
from __future__ import annotations

import numbers
import socket
from typing import List, Sequence

import torch

from .. import codec
from .deadline import Deadline
from .errors import MismatchError
from .store import swap_through_store


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return "rocm" if torch.version.hip else "cuda"
    return "cpu"


def rank_facts(group, device: torch.device, deadline: Deadline, domains=None, listen=None) -> List[dict]:
    """Every rank's {kind, host, build, domains (its domains= argument),
    addr and why (its listening candidate, address.py)}, swapped through the
    job's store (keyed by the private group's unique name)."""
    build = codec.device_vendor() if codec.has_device_code() else "cpu"  # the device code this rank's build can run
    addr, why = (listen.ip, listen.why.replace("|", "/")) if listen is not None else ("", "")
    me = (f"{device_kind(device)}|{socket.gethostname()}|{build}:{codec.FORMAT_VERSION}|{_canonical(domains)}|"
          f"{addr}|{why}")
    return swap_through_store(group, "facts", me, deadline, "its device facts", parse=parse_facts)


def parse_facts(v: bytes) -> dict:
    """One rank's record (kind|host|build:format|domains[|addr|why]); ValueError if it is not one."""
    fields = v.decode().split("|")
    if len(fields) not in (4, 6):
        raise ValueError(f"{len(fields)} '|'-separated fields, not 6")
    kind, host, build, doms = fields[:4]
    addr, why = fields[4:] if len(fields) == 6 else ("", "")
    if kind not in ("cuda", "rocm", "cpu"):
        raise ValueError(f"device kind {kind!r} is none of cuda, rocm, cpu")
    if build.count(":") != 1:
        raise ValueError(f"build {build!r} is not vendor:format")
    return {"kind": kind, "host": host, "build": build, "domains": doms, "addr": addr, "why": why}


def _canonical(domains) -> str:
    """domains= as every rank should have passed it (lists and tuples alike)."""
    try:
        if domains is None or isinstance(domains, str):
            return repr(domains)
        return repr(sorted(sorted(int(r) for r in d) for d in domains))
    except (TypeError, ValueError):
        return repr(domains).replace("|", "/")


def resolve(domains, facts: List[dict], transport: str) -> List[List[int]]:
    """The domains as sorted lists of group ranks, sorted by first rank.
    domains: None (detect), "host" (vendor + host), or a list of rank lists."""
    world = len(facts)
    if domains is None:
        if transport == "fabric":  # every rank alone: all traffic over the fabric
            return [[r] for r in range(world)]
        key = [f["kind"] for f in facts]  # one torch backend spans hosts of one vendor
    elif domains == "host":
        key = [(f["kind"], f["host"]) for f in facts]
    else:
        if isinstance(domains, (str, bytes)) or not isinstance(domains, Sequence):
            raise TypeError(f"domains must be None, 'host' or a list of rank lists, got {domains!r}")
        seen, out = set(), []
        for d in domains:
            if isinstance(d, (str, bytes)) or not isinstance(d, Sequence) or not d:
                raise TypeError(f"each domain must be a non-empty list of ranks, got {d!r}")
            for r in d:
                if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= r < world:
                    raise ValueError(f"domain rank {r!r} is not a rank of this group (size {world})")
                if r in seen:
                    raise ValueError(f"rank {r} is in two domains")
                seen.add(int(r))
            out.append(sorted(int(r) for r in d))
        if len(seen) != world:
            raise ValueError(f"domains must cover every rank of the group; missing {sorted(set(range(world)) - seen)}")
        for d in out:
            kinds = {facts[r]["kind"] for r in d}
            if len(kinds) > 1:
                raise ValueError(f"domain {d} mixes device kinds {sorted(kinds)}: no native path connects them")
        return sorted(out)
    groups = {}
    for r, k in enumerate(key):
        groups.setdefault(k, []).append(r)
    return sorted(groups.values())


def check_facts(facts: List[dict]) -> None:
    if len({f["domains"] for f in facts}) > 1:
        raise MismatchError("domains= differs between ranks: " +
                            ", ".join(f"rank {j} {f['domains']}" for j, f in enumerate(facts)))
    builds = {f["build"].split(":")[1] for f in facts}
    if len(builds) > 1:
        raise MismatchError("ranks run portable_zip builds with different stream formats: " +
                            ", ".join(f"rank {j} {f['build']}" for j, f in enumerate(facts)))


def domain_group(group, members: List[int], kind: str):
    """This rank's domain's group (NCCL/RCCL for GPUs, gloo for CPUs) of
    group (a Group); only members call it."""
    return group.sub(members, "nccl" if kind in ("cuda", "rocm") else "gloo")
