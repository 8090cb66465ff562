"""What the pz backend moved, for users: pz.stats(group) and the one-line
summary PZ_STATS=1 prints per group at destroy_process_group."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def stats(group=None) -> dict:
    """What the "pz" backend moved on group (default: the default group), by
    device kind ("cpu", "cuda"), then op: {"calls", "raw_bytes" (the
    tensors' bytes), "wire_bytes" (what crossed the link), "time_s",
    "plans": {"compressed"|"raw"|"native"|...: calls}}. "native" calls went
    to the inner backend (gloo, NCCL) as they were. {} where pz moved
    nothing (another backend, or no op yet); this rank's view."""
    g = group if group is not None else dist.group.WORLD
    if g is None:
        raise RuntimeError("pz.stats: no default process group (init_process_group first), and no group given")
    if hasattr(g, "stats"):  # the pz ProcessGroup itself ("pz" for every device kind)
        return g.stats
    out: dict = {}
    for kind in ("cpu", "cuda"):
        try:
            b = g._get_backend(torch.device(kind))
        except (RuntimeError, ValueError):
            continue
        if hasattr(b, "stats"):
            out.update({k: v for k, v in b.stats.items() if k == kind})
    return out


def _gb(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def summary(st: dict, name: str, rank: int, world: int) -> Optional[str]:
    """One line per group: per op, calls, raw -> wire bytes and the plans taken."""
    parts = []
    for kind, ops in sorted(st.items()):
        for op, s in sorted(ops.items()):
            ratio = f" ({s['wire_bytes'] / s['raw_bytes']:.3f})" if s["raw_bytes"] else ""
            plans = ", ".join(f"{n} {p}" for p, n in sorted(s["plans"].items()))
            parts.append(f"{op}[{kind}] {s['calls']} calls, {_gb(s['raw_bytes'])} -> {_gb(s['wire_bytes'])}{ratio}: "
                         f"{plans}")
    if not parts:
        return None
    return f"pz stats, group {name} (rank {rank} of {world}): " + "; ".join(parts)
