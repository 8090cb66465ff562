"""pz.weights stats count the raw bytes of a round on every rank: a
receiver the rows it took, a sender the rows it sent, once per receiver
(as sent_bytes counts what it handed over), in full rounds and delta
rounds alike."""
import pytest

import comm_harness
import weights_workers as ww
from portable_zip.weights import engine

SEED = 77


def rounds(rank, world, seed, n):
    """Rank 0 sends `n` versions of every weight to the others; every rank's
    stats of each round, with the raw bytes of the weights."""
    ww.use_delta()
    comm = ww.communicator()
    if rank == 0:
        s = engine.Sender(comm, bucket_bytes=2000)
        stats = [s.send(ww.model(seed, v), v) for v in range(n)]
    else:
        r, into = engine.Receiver(comm), ww.buffers()
        stats = [r.receive(into) for _ in range(n)]
    comm.close()
    total = sum(t.numel() * t.element_size() for t in ww.buffers().values())
    return total, [[{k: p[k] for k in ("raw_bytes", "sent_bytes", "received_bytes", "delta")} for p in st]
                   for st in stats]


@pytest.mark.parametrize("world", [2, 3])
def test_raw_bytes_of_a_round(world):
    res = comm_harness.run(world, rounds, SEED, 3, deadline=120)
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, bad
    receivers = world - 1
    for r, (_, (total, st)) in res.items():
        for k, parts in enumerate(st):
            raw = sum(p["raw_bytes"] for p in parts)
            assert raw == (total * receivers if r == 0 else total), (r, k, parts)
    sender = res[0][1][1]
    assert sum(p["delta"] for p in sender[1]) > 0  # a delta round: fewer bytes handed over than raw
    assert 0 < sum(p["sent_bytes"] for p in sender[1]) < sum(p["raw_bytes"] for p in sender[1]), sender
