"""pz.weights under refused rounds (issue 36): receive buffers that share
bytes and a name sent twice raise MismatchError on every rank, promptly and
before any byte moves, and the same engines then sync bit-exact; the
overlap test is exact for contiguous buffers and never misses one for
strided views. Each multi-rank run draws fresh random data (its seed is in
the failure message)."""
import os
import re
import time

import numpy as np
import pytest
import torch

import comm_harness
import portable_zip as pz
import weights_workers as ww
from portable_zip.comm.errors import MismatchError
from portable_zip.weights import engine
from portable_zip.weights import plan as P

# Round 1's receive buffers per case, and the two names the refusal must give.
OVERLAP = {
    "views": ("w", "a"),   # two views of one buffer: rows 50-64 of it in both
    "alias": ("x", "y"),   # one tensor under two names
    "inside": ("w", "b"),  # a row of 'w' handed in as 'b'
}
MODE = {"views": "never", "alias": "auto", "inside": "always"}  # every compress mode, at 2 and 3 ranks


def _tensors(seed, version):
    g = torch.Generator().manual_seed(seed * 1000 + version)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    return {"a": r(40, 16), "b": r(16), "w": r(64, 16), "x": r(8, 16), "y": r(8, 16)}


def _into(case):
    """Round 1's receive buffers, filled with a pattern that a moved byte would change."""
    def fill(*shape):
        n = int(np.prod(shape))
        return torch.arange(1, n + 1, dtype=torch.float32).reshape(shape).to(torch.bfloat16)

    into = {"a": fill(40, 16), "b": fill(16), "w": fill(64, 16), "x": fill(8, 16), "y": fill(8, 16)}
    if case == "views":
        buf = fill(100, 16)
        into["w"], into["a"] = buf[:64], buf[50:90]
    elif case == "alias":
        into["y"] = into["x"]
    elif case == "inside":
        into["b"] = into["w"][3]
    return into


def overlap_rounds(rank, world, seed, case):
    """Round 0 syncs bit-exact into separate buffers; round 1's receive
    buffers overlap (`case`); round 2 goes over the same engines and
    Communicator. Per round: the outcome, its seconds, and on a receiver
    whether its buffers changed, whether they hold the sender's bytes, and
    the stats' repairs (a round that returns)."""
    impl = ww.use_delta()
    comm = pz.Communicator(compress=MODE[case], timeout=10)
    out = []
    eng = engine.Sender(comm, bucket_bytes=512) if rank == 0 else engine.Receiver(comm)
    good = {n: torch.zeros_like(t) for n, t in _tensors(seed, 0).items()}
    for v in range(3):
        into = _into(case) if v == 1 else good
        before = {n: t.clone() for n, t in into.items()}
        t0 = time.monotonic()
        repaired = None
        try:
            st = eng.send(_tensors(seed, v), v) if rank == 0 else eng.receive(into)
            what, repaired = "returned", sum(p["repaired"] for p in st)
        except MismatchError as e:
            what = f"MismatchError: {e}"
        took = time.monotonic() - t0
        want = _tensors(seed, v)
        moved = rank > 0 and not all(ww.same(into[n], before[n]) for n in into)
        exact = rank == 0 or all(ww.same(into[n], want[n]) for n in into)
        out.append((what, took, moved, exact, repaired))
    torch.distributed.barrier()  # no rank leaves while another still runs
    return impl, out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", sorted(OVERLAP))
def test_overlapping_receive_buffers_refused_on_every_rank(world, case):
    """Before: every round returned, 'repaired' in its stats, and the receiver held other bytes than the sender's."""
    seed = int.from_bytes(os.urandom(4), "little")
    res = comm_harness.run(world, overlap_rounds, seed, case, deadline=120)
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, (seed, bad)
    a, b = OVERLAP[case]
    for r, (_, (_, rounds)) in res.items():
        (w0, _, _, x0, _), (w1, t1, moved, _, rep1), (w2, _, _, x2, _) = rounds
        assert w0 == "returned" and x0 and w2 == "returned" and x2, (seed, r, rounds)
        assert w1.startswith("MismatchError") and f"overlap in memory: {a!r} and {b!r}" in w1, (seed, r, rounds[1])
        assert not moved and t1 < 5, (seed, r, rounds[1])


def name_twice(rank, world, seed, where):
    """Rank 0 sends 'w' twice, in one part or in two parts of one round: every rank raises MismatchError."""
    ww.use_delta()
    comm = ww.communicator(timeout=10)
    t = _tensors(seed, 0)
    t0 = time.monotonic()
    try:
        if rank == 0:
            if where == "part":
                engine.Sender(comm).send([("w", t["w"]), ("a", t["a"]), ("w", t["w"])], 0)
            else:  # parts of ~one tensor each: 'w' comes back in the third part
                engine.Sender(comm, part_bytes=1024).send([("w", t["w"]), ("a", t["a"]), ("w", t["w"])], 0)
        else:
            engine.Receiver(comm).receive({"w": torch.zeros_like(t["w"]), "a": torch.zeros_like(t["a"])})
        what = "returned"
    except Exception as e:  # noqa: BLE001 - the test compares every rank's outcome
        what = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    torch.distributed.barrier()  # a trainer lives on after its error: no rank leaves before the others end
    return what, took


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("where", ["part", "round"])
def test_name_sent_twice_raises_on_every_rank(world, where):
    seed = int.from_bytes(os.urandom(4), "little")
    res = comm_harness.run(world, name_twice, seed, where, deadline=90)
    pattern = r"sends weight 'w' twice in one part" if where == "part" else r"sends \['w'\] again"
    assert all(res[r][0] == "ok" for r in range(world)), (seed, res)
    outcome = {r: (res[r][1][0][:120], round(res[r][1][1], 2)) for r in range(world)}
    for r in range(world):
        what, took = res[r][1]
        assert what.startswith("MismatchError") and re.search(pattern, what) and took < 5, (seed, outcome)


def test_overlapping_finds_every_overlap_among_thousands():
    """The sweep against brute force, on random spans (touching ends do not overlap)."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    for trial in range(30):
        n = int(rng.integers(2, 40)) if trial else 4000
        a = rng.integers(0, 5000 if trial else 10 ** 9, n)
        spans = [(int(x), int(x + rng.integers(0, 200)), f"t{i}") for i, x in enumerate(a)]
        brute = any(max(s[0], t[0]) < min(s[1], t[1]) for i, s in enumerate(spans) for t in spans[:i]) \
            if n < 100 else None
        t0 = time.perf_counter()
        pairs = P.overlapping(spans)
        took = time.perf_counter() - t0
        if brute is not None:
            assert bool(pairs) == brute, spans
        by = {s[2]: s for s in spans}
        assert all(max(by[p][0], by[q][0]) < min(by[p][1], by[q][1]) for p, q in pairs)
        if n == 4000:
            assert took < 0.5, took


def test_spans_of_views():
    """Contiguous views: exact. Strided views: a bounding range, so interleaved ones count as overlapping."""
    base = torch.zeros(10, 8, dtype=torch.float32)
    span = engine._span
    assert span(base) == (base.data_ptr(), base.data_ptr() + 320)
    assert span(base[2:4]) == (base.data_ptr() + 64, base.data_ptr() + 128)
    assert P.overlapping([(*span(base[:5]), "a"), (*span(base[5:]), "b")]) == []  # adjacent rows
    col0, col1 = base[:, 0], base[:, 1]  # disjoint bytes, interleaved
    assert P.overlapping([(*span(col0), "c0"), (*span(col1), "c1")]) == [("c0", "c1")]
    assert span(base[:0]) == (0, 0) and P.overlapping([(*span(base[:0]), "e"), (*span(base), "f")]) == []
    alias = torch.frombuffer(base.numpy(), dtype=torch.float32)  # another storage over the same memory
    assert P.overlapping([(*span(alias), "x"), (*span(base[3]), "y")]) == [("x", "y")]


def test_receiver_refuses_before_the_swap_locally_too():
    """Receiver._shared_bytes names the pairs (what every rank's MismatchError carries)."""
    t = torch.zeros(6, 4)
    why = engine.Receiver._shared_bytes({"p": t, "q": t[2:4], "r": torch.zeros(3)})
    assert "'p' and 'q'" in why and "'r'" not in why
    assert engine.Receiver._shared_bytes({"p": t[:3], "q": t[3:]}) is None
    with pytest.raises(MismatchError, match=r"rank 1 has receive buffers that overlap"):
        P.check_refused([{"role": "send"}, {"role": "recv", "refuse": why}])
