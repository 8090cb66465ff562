"""Soak: 3 ranks run 2,500 random ops (PZ_SOAK_OPS for a longer soak) of every
kind, dtype (bf16, fp16, fp32, fp8 e4m3fn/e5m2, int32), log-uniform size up
to 8 MiB and mode (auto, always, never, and an auto told of a slow link so its
plan switches with the size), each checked against torch.distributed on the
same inputs; host RSS after the warm-up (a fifth of the ops) and at the end
within 5%, each the floor of the readings over a fifth of the ops (a leak
raises the floor; one reading also counts what the allocator's arenas held at
that moment: on CI one reading grew 6.3% where the floors stayed flat). A fresh seed every run, printed on failure.
Runs with PZ_CHECK_PLANS=1 unless the environment sets it.
"""
import os

import numpy as np

import comm_harness
import comm_soak_workers as csw

OPS = int(os.environ.get("PZ_SOAK_OPS", 2500))
WARM = max(OPS // 5, 1)  # RSS still ramps over the first few hundred ops (at 200: +6% by the end)
EVERY = max(OPS // 50, 1)  # VmRSS read this often (50 readings)


def floors(o):
    """The lowest VmRSS over the fifth of the ops after the warm-up, and over
    the last fifth (with the end reading), KiB."""
    trace = [(i, m["rss_kib"]) for i, m, _ in o["trace"]]
    warm = [k for i, k in trace if WARM <= i < 2 * WARM] or [o["warm"]["rss_kib"]]
    end = [k for i, k in trace if i >= OPS - WARM] + [o["end"]["rss_kib"]]
    return min(warm), min(end)


def test_soak(monkeypatch):
    monkeypatch.setenv("PZ_CHECK_PLANS", os.environ.get("PZ_CHECK_PLANS", "1"))
    # A fixed mmap threshold: glibc's default one rises to the largest tensor
    # freed, after which multi-MiB tensors come from the heap, and its
    # fragmentation grew VmRSS 14-30% over 4,500 ops (20% even after
    # malloc_trim) where a fixed threshold measured +1.4%: that growth is the
    # allocator's, not a leak. Tensors of 64 KiB and up are then mmapped.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    seed = int(np.random.default_rng().integers(0, 2**31))
    res = comm_harness.run(3, csw.soak, seed, OPS, 8 << 20, tuple(csw.MODES), WARM, 120.0, EVERY, deadline=1200)
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, f"seed {seed}:\n" + "\n".join(f"rank {r}: {s}: {v}" for r, (s, v) in bad.items())
    out = {r: res[r][1] for r in sorted(res)}
    for r, o in out.items():
        w, e = o["warm"], o["end"]
        fw, fe = floors(o)
        print(f"rank {r}: {o['ops']} ops in {o['seconds']:.1f} s, {o['bytes'] / 2**30:.2f} GiB of inputs; VmRSS "
              f"{w['rss_kib'] / 1024:.1f} MiB after {WARM} ops, {e['rss_kib'] / 1024:.1f} MiB at the end; floors "
              f"{fw / 1024:.1f} -> {fe / 1024:.1f} MiB; after malloc_trim {w['rss_trimmed_kib'] / 1024:.1f} -> "
              f"{e['rss_trimmed_kib'] / 1024:.1f} MiB; objects grown {o.get('objects_grown')}; ops {o['counts']}")
    for r, o in out.items():
        assert o["ops"] == OPS and sum(o["counts"].values()) == OPS, (seed, r, o["counts"])
        w, e = floors(o)
        assert e <= 1.05 * w, (f"seed {seed}: rank {r}'s VmRSS floor grew {100 * (e / w - 1):.1f}% after the warm-up: "
                               f"{w} -> {e} KiB; objects grown {o.get('objects_grown')}; readings "
                               f"{[(i, m['rss_kib']) for i, m, _ in o['trace']]}")
    if OPS >= 1000:  # enough draws that each mode meets each kind of op
        plans = out[0]["plans"]
        slow = {p for s in plans["auto-slow"].values() for p in s}
        assert {"native", "compressed"} <= slow, f"seed {seed}: auto-slow never switched plans: {plans['auto-slow']}"
        assert set(plans["always"]["all_reduce"]) == {"compressed"}, plans["always"]
        assert {p for s in plans["never"].values() for p in s} == {"raw"}, plans["never"]


def test_floors_see_a_leak():
    """The floors catch steady growth that the noise of single readings hides."""
    rng = np.random.default_rng()
    base = 190_000

    def run(leak_per_op):
        trace = [(i, {"rss_kib": base + leak_per_op * i + int(rng.integers(0, 6000))}, None)
                 for i in range(0, OPS, EVERY)]
        return {"trace": trace, "warm": trace[WARM // EVERY][1], "end": {"rss_kib": base + leak_per_op * OPS}}

    w, e = floors(run(0))
    assert e <= 1.05 * w
    # 16 KiB an op (a 4 KiB buffer kept by every op of each of 4 workers): the
    # windows' floors then differ by more than 5% whatever the 6 MiB of noise
    # (at 8 KiB an op they did not always: CI drew noise that hid it)
    w, e = floors(run(16))
    assert e > 1.05 * w
