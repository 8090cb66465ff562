"""Push over tcp;ofi_rxm (the engine's default there): every chunk travels
eagerly, and a sender stays within a window of chunks its peer has not yet
received, which the peer's credits reopen. Credits cycle bit-exactly at a
window of 4 chunks (a credit a chunk), staged and not, both ways at once
between every pair; a receiver that posts late holds at most a window, not
what the sender has; a sender that closes before its peer receives still
delivers, and one whose peer leaves without receiving closes at once;
ranks whose push settings differ are told so."""
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import comm_harness
import fabric_workers
import test_fabric_strangers as strangers
from portable_zip import _C
from harness.ranks import ok

pytestmark = pytest.mark.skipif(not _C.has_fabric or bool(_C.fabric_probe()),
                                reason=f"no fabric transport here: {_C.fabric_probe()}")
TCP = {"PZ_FABRIC_PROVIDER": "tcp;ofi_rxm"}
CHUNK = 64 << 10


def run(world, fn, *args, env=None, deadline=300.0):
    return comm_harness.run(world, fn, *args, env={**TCP, **(env or {})}, deadline=deadline)


def seed():
    return int(np.random.default_rng().integers(0, 2**31))


def _bytes(seed, src, dst, k, n):
    return torch.from_numpy(np.random.default_rng([seed, src, dst, k]).integers(0, 256, n, dtype=np.uint8))


def both_ways(rank, world, seed, rounds):
    """Every pair moves several MiB each way at once, `rounds` times, raw
    through the transport (fresh bytes per round, rank and peer); returns
    the byte-exact count and the engine's push line."""
    import portable_zip as pz

    comm = pz.Communicator(compress="never", transport="fabric", timeout=60)
    rng = np.random.default_rng([seed, 99])
    exact = 0
    for k in range(rounds):
        n = int(rng.integers(3 << 20, 6 << 20)) | 1  # the same size on every rank: one generator
        works, want = [], []
        for p in range(world):
            if p != rank:
                works.append(comm.isend(_bytes(seed, rank, p, k, n), p))
                got = torch.empty(n, dtype=torch.uint8)
                works.append(comm.irecv(got, p))
                want.append((got, _bytes(seed, p, rank, k, n)))
        for w in works:
            w.wait()
        exact += sum(bool(torch.equal(g, e)) for g, e in want)
    push = comm.tp.info["push"]
    comm.close()
    return exact, push


@pytest.mark.parametrize("world,stage", [(2, "0"), (3, "1")])
def test_credits_cycle_exactly_both_ways(world, stage):
    env = {"PZ_FABRIC_CHUNK": str(CHUNK), "PZ_FABRIC_WINDOW": str(4 * CHUNK), "PZ_FABRIC_STAGE": stage}
    res = ok(run(world, both_ways, seed(), 4, env=env))
    for exact, push in res.values():
        assert exact == 4 * (world - 1), res
        assert "a window of 4 chunks" in push, push


@pytest.mark.parametrize("world,rails", [(2, 3), (3, 1)])
def test_staging_ring_edges_under_a_small_window(world, rails):
    """fabric_workers.staged_edges (every size edge of a 64 KiB chunk, raw and
    coded, several tensors a peer) with a credit after every chunk."""
    env = {"PZ_FABRIC_STAGE": "1", "PZ_FABRIC_CHUNK": str(CHUNK), "PZ_FABRIC_RAILS": str(rails),
           "PZ_FABRIC_DEPTH": "2", "PZ_FABRIC_WINDOW": str(4 * CHUNK)}
    res = ok(run(world, fabric_workers.staged_edges, seed(), env=env))
    assert all(n == 2 * 9 * 3 * 2 * (world - 1) for n, _ in res.values()), res
    assert "a window of 4 chunks" in res[0][1]["push"], res[0][1]


def test_a_late_receiver_holds_a_window_not_the_stream(tmp_path):
    """Eager chunks nobody has asked for yet are buffered by rxm at the
    receiver; without the window a late receiver's memory grows with the
    time it is late (about 14 MB/s on this VM, 112 MB after 8 s, for a
    1 GiB send). With a 1 MiB window the sender stops after a window: the
    receiver grows in its first second (the window and rxm's own
    allocations: about 17 MB at a window of 1 MiB, 20 at 4) and not after,
    and the sender's wait ends only after the receive is posted. Measured by
    bench/late_receiver.py (which also runs wider windows)."""
    late = 5.0
    bench = Path(__file__).resolve().parents[1] / "bench" / "late_receiver.py"
    out = tmp_path / "late.json"
    r = subprocess.run([sys.executable, "-P", str(bench), "--mb", "512", "--late", str(late), "--windows", "1MiB",
                        "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["exact"] and "a window of 4 chunks" in row["push"], row
    assert row["later_mb"] < 6, f"the late receiver grew by {row['later_mb']:.1f} MB over its last {late - 1:.0f} s"
    assert row["first_s_mb"] + row["later_mb"] < 40, row
    assert row["send_s"] > late - 1.0, row


def sends_then_closes(rank, world, seed, late_s, receive):
    """Through the Communicator's own transport (the watch included): rank 0
    sends 3 MiB (12 eager chunks inside the 4 MiB window, so its wait ends
    before rank 1 has asked) and closes at once; rank 1, late_s later,
    receives them (receive) or closes without. Returns rank 0's send and
    close times, rank 1's exactness."""
    import portable_zip as pz
    from portable_zip.comm.deadline import Deadline

    comm = pz.Communicator(compress="never", transport="fabric", timeout=30)
    comm.all_reduce(torch.ones(64))
    data = _bytes(seed, 0, 1, 1, 3 << 20)
    if rank == 0:
        t0 = time.monotonic()
        comm.tp.wait(comm.tp.post([("send", data, 1)]), Deadline(30))
        t1 = time.monotonic()
        comm.close()
        return t1 - t0, time.monotonic() - t1
    time.sleep(late_s)
    out = None
    if receive:
        got = torch.empty_like(data)
        comm.tp.wait(comm.tp.post([("recv", got, 0)]), Deadline(30))
        out = bool(torch.equal(got, data))
    comm.close()
    return out


def test_a_sender_that_closes_before_its_peer_receives_still_delivers():
    """Its close waits for the credits due (drain): one left unread when its
    endpoints close would reset the connection and drop what the peer has
    not read. They come once rank 1 receives."""
    late = 2.0
    res = ok(run(2, sends_then_closes, seed(), late, True, env={"PZ_CHECK_PLANS": "0"}, deadline=120))
    (send_s, close_s), exact = res[0], res[1]
    assert exact, res
    assert send_s < late / 2, f"the send waited {send_s:.2f} s for a receiver {late} s late: not pushed"
    assert late / 2 < close_s < late + 3, res


def test_a_peer_that_leaves_without_receiving_owes_no_credits():
    """Rank 1 closes without receiving: its goodbye ends rank 0's drain, not the 5 s bound."""
    late = 1.0
    res = ok(run(2, sends_then_closes, seed(), late, False, env={"PZ_CHECK_PLANS": "0"}, deadline=120))
    send_s, close_s = res[0]
    assert send_s < late / 2 and close_s < late + 2.5, res


def test_push_settings_that_differ_are_named():
    """The address carries the window (chunks) and rxm's eager limit after
    the rails' names: a peer with another window is a clear error, never a
    connection rxm refuses in silence."""
    e = strangers._engine(0, 2, os.urandom(16))  # 2 MiB chunks: the 4 MiB window rounds up to 4 chunks
    try:
        mine = e.address()
        assert "window" in e.info()["push"], e.info()
        win, eager = struct.unpack_from("<IQ", mine, len(mine) - 12)
        assert win == 4 and eager == int(os.environ.get("FI_OFI_RXM_EAGER_LIMIT", 1 << 20)), (win, eager)
        other = mine[:-12] + struct.pack("<IQ", win * 2, eager)
        with pytest.raises(ValueError, match="push settings differ between rank 1 and rank 0"):
            e.connect([mine, other])
    finally:
        e.close()


def test_a_later_engine_without_push_keeps_rxm_default():
    """The eager limit is set only while a push engine's endpoints open: an
    engine without push made later in the process sends large chunks by
    rendezvous (rxm's 16 KiB limit, in its address), never eagerly without
    a window."""
    if "FI_OFI_RXM_EAGER_LIMIT" in os.environ:
        pytest.skip("the user's FI_OFI_RXM_EAGER_LIMIT decides here")
    first = strangers._engine(0, 2, os.urandom(16))
    first.close()
    e = _C.FabricEngine(strangers.PROVIDER, 2, 2 << 20, 4, False, -1, 0, 2, True, 2000, os.urandom(16), "", window=0)
    try:
        a = e.address()
        rxm_default = int(os.environ.get("FI_OFI_RXM_BUFFER_SIZE", 16384))  # rxm's eager limit: its buffer size
        assert struct.unpack_from("<IQ", a, len(a) - 12) == (0, rxm_default), a[-12:]
        assert e.info()["push"].startswith("off"), e.info()
    finally:
        e.close()


def test_without_rxm_eager_sends_the_engine_keeps_rendezvous_defaults(monkeypatch):
    """rxm sends our chunks eagerly only with dynamic receive buffers and
    direct send: with either off, push is off and the defaults are
    rendezvous's (2 rails of 2 MiB), not push's one rail of 256 KiB."""
    for var in ("FI_OFI_RXM_ENABLE_DYN_RBUF", "FI_OFI_RXM_ENABLE_DIRECT_SEND"):
        with monkeypatch.context() as m:
            m.setenv(var, "0")
            e = _C.FabricEngine(strangers.PROVIDER, 0, 0, 0, False, -1, 0, 2, True, 2000, os.urandom(16), "")
            try:
                info = e.info()
                assert info["push"].startswith("off") and (info["rails"], info["chunk"]) == ("2", str(2 << 20)), info
            finally:
                e.close()
