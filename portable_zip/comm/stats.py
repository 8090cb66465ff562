"""Per-op counters behind `.stats` (Communicator, the pz backend's point to
point, the hooks): calls, raw bytes, wire bytes, time and plans."""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Iterable


def _fresh() -> dict:
    return {"calls": 0, "raw_bytes": 0, "wire_bytes": 0, "time_s": 0.0, "plans": defaultdict(int)}


class Stats:
    def __init__(self):
        self._ops = defaultdict(_fresh)

    def record(self, op: str, plan: str, t0: float, raw: int, wire: int, calls: int = 1) -> None:
        """calls more of op under plan, moving raw bytes as wire bytes, since t0 (perf_counter)."""
        self.add(op, plan, calls, raw, wire, time.perf_counter() - t0)

    def add(self, op: str, plan: str, calls: int, raw: int, wire: int, seconds: float) -> None:
        """calls of op already timed elsewhere (seconds in all)."""
        s = self._ops[op]
        s["calls"] += calls
        s["raw_bytes"] += int(raw)
        s["wire_bytes"] += int(wire)
        s["time_s"] += seconds
        s["plans"][plan] += calls

    def view(self) -> dict:
        """The ops called so far, as plain dicts."""
        return {op: {**s, "plans": dict(s["plans"])} for op, s in self._ops.items() if s["calls"]}


def merged(views: Iterable[dict]) -> dict:
    """Several views summed, per op."""
    out: dict = {}
    for st in views:
        for op, s in st.items():
            o = out.setdefault(op, {**_fresh(), "plans": {}})
            for k in ("calls", "raw_bytes", "wire_bytes", "time_s"):
                o[k] += s[k]
            for plan, n in s["plans"].items():
                o["plans"][plan] = o["plans"].get(plan, 0) + n
    return out
