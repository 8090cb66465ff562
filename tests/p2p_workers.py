"""Per-rank bodies of the one point-to-point path's tests (tests/test_p2p.py)."""
import os
import time

import torch
import torch.distributed as dist

import portable_zip as pz
from comm_workers import check, data, empty, same
from portable_zip.c10d import Options
from portable_zip.comm.observed import LinkSeen


def tags_match_per_tag(rank, world, seed, mode):
    """Messages match per (source, destination, tag) in posting order: the
    receiver posts its tags in another order than the sender sent them (the
    early ones are staged until their receives come), and within a tag the
    order holds. Group counts are per tag: the sender's one group of four
    meets the receiver's groups of one and three."""
    comm = pz.Communicator(compress=mode, timeout=30)
    n = 50_000
    if rank == 0:
        works = [comm.isend(data(seed, 0, k, n + k, torch.bfloat16), 1, tag=tag)
                 for k, tag in enumerate([5, 7, 5, 9])]
        for w in works:
            w.wait()
        return "sent"
    got = {k: empty(n + k, dtype=torch.bfloat16) for k in range(4)}
    comm.irecv(got[3], 0, tag=9).wait()  # the last one sent: the three before it wait staged
    works = [comm.irecv(got[1], 0, tag=7), comm.irecv(got[0], 0, tag=5), comm.irecv(got[2], 0, tag=5)]
    for w in works:
        w.wait()
    ok = {k: same(t, data(seed, 0, k, n + k, torch.bfloat16)) for k, t in got.items()}
    check(all(ok.values()), f"tags matched wrongly: {ok}")
    return comm.stats["recv"]["plans"]


def announced_size(rank, world, seed, mode):
    """recv_tensor: a new tensor of the dtype and size the sender announces,
    for every dtype, in pieces (PZ_PIECE_BYTES), staged (sent before the
    receive is posted) or not; a message over max_bytes is refused on both
    ranks and the pair goes on."""
    comm = pz.Communicator(compress=mode, timeout=30)
    kinds = [(torch.bfloat16, 300_001), (torch.float16, 7), (torch.float32, 65_537), (torch.uint8, 12_345),
             (torch.float8_e4m3fn, 100_003), (torch.int64, 0)]
    if rank == 0:
        works = [comm.isend(data(seed, 0, k, n, dt), 1, tag=k % 2).start() for k, (dt, n) in enumerate(kinds)]
        for w in works:
            w.wait()
        try:
            comm.send(data(seed, 0, 99, 1000, torch.bfloat16), 1, tag=3)
            refused = "no error"
        except pz.MismatchError as e:
            refused = str(e)
        comm.send(data(seed, 0, 100, 5, torch.float16), 1, tag=3)  # the pair goes on
        return refused
    # Tag 1 first: each tag-0 message ahead of it is read and staged, then taken from staging.
    got = {}
    for k in (1, 0, 3, 2, 5, 4):
        got[k] = comm.recv_tensor(0, tag=k % 2)
    for k, (dt, n) in enumerate(kinds):
        t = got[k]
        check(t.dtype == dt and t.shape == (n,) and t.device == comm.device, f"{k}: {t.dtype} {tuple(t.shape)}")
        check(same(t, data(seed, 0, k, n, dt)), f"message {k} ({dt}) differs")
    try:
        comm.recv_tensor(0, tag=3, max_bytes=1999)
        refused = "no error"
    except pz.MismatchError as e:
        refused = str(e)
    work = comm.irecv_tensor(0, tag=3, max_bytes=10)
    last = work.result()
    check(same(last, data(seed, 0, 100, 5, torch.float16)), "the message after a refused one differs")
    return refused


def mismatch_in_mode(rank, world, mode, case, via):
    """A receive whose size or dtype differs from the send raises MismatchError on both ranks, in every mode
    (issue: under "never" a 200,000-element bf16 send into 200,001 elements or fp16 used to return)."""
    n = 200_000
    recv = {"size": (n + 1, torch.bfloat16), "dtype": (n, torch.float16)}[case]
    if via == "backend":
        g = dist.new_group(backend="pz", pg_options=Options(compress=mode, timeout=20.0))
        send = lambda t: dist.send(t, 1, group=g)  # noqa: E731
        rcv = lambda t: dist.recv(t, 0, group=g)  # noqa: E731
    else:
        comm = pz.Communicator(compress=mode, timeout=20)
        send, rcv = (lambda t: comm.send(t, 1)), (lambda t: comm.recv(t, 0))
    try:
        if rank == 0:
            send(torch.zeros(n, dtype=torch.bfloat16))
        else:
            rcv(torch.empty(recv[0], dtype=recv[1]))
    except pz.MismatchError as e:
        return str(e)
    return "no error"


def pieces_and_corruption(rank, world, seed):
    """A message cut into several compressed pieces lands exactly; a corrupt
    piece fails that message on both ranks, and the pair goes on."""
    import portable_zip.codec as codec

    comm = pz.Communicator(compress="always", timeout=30)
    n = 3 * 8192 * 16 + 4321  # PZ_PIECE_BYTES=131072: four bf16 pieces, the last short
    out = []
    if rank == 0:
        comm.send(data(seed, 0, 1, n, torch.bfloat16), 1)
        good, calls = codec.compress, [0]

        def corrupt_second(t, *a, **k):
            buf = good(t, *a, **k)
            calls[0] += 1
            if calls[0] == 2:
                size = int(codec.size_field(buf).view(torch.int64)[0])
                buf[size // 3] ^= 0x5A  # a byte of the raw planes: the decoded values change, the checksum must see it
            return buf
        codec.compress = corrupt_second
        try:
            comm.send(data(seed, 0, 2, n, torch.bfloat16), 1)
            out.append("sent")
        except pz.PeerError as e:
            out.append(str(e))
        codec.compress = good
        comm.send(data(seed, 0, 3, n, torch.bfloat16), 1)
        return out
    for k in (1, 2, 3):
        t = empty(n, dtype=torch.bfloat16)
        try:
            comm.recv(t, 0)
            out.append(same(t, data(seed, 0, k, n, torch.bfloat16)))
        except pz.PeerError as e:
            out.append(str(e))
    out.append(comm.stats["recv"]["calls"])
    return out


def receiver_exits_at_once(rank, world, seed):
    """A receiver that leaves right after its recv (no close) leaves its sender with a completed send:
    a receive completes only once its ACK is out."""
    comm = pz.Communicator(compress="always", timeout=20)
    if rank == 1:
        t = empty(100_000, dtype=torch.bfloat16)
        comm.recv(t, 0)
        os._exit(0 if same(t, data(seed, 0, 0, 100_000, torch.bfloat16)) else 3)
    t0 = time.monotonic()
    comm.send(data(seed, 0, 0, 100_000, torch.bfloat16), 1)
    return time.monotonic() - t0


def third_rank_unaffected(rank, world, seed):
    """Ranks 0 and 1 mismatch; rank 2's transfers with both finish normally."""
    comm = pz.Communicator(compress="auto", timeout=20)
    res = []
    if rank in (0, 1):
        try:
            if rank == 0:
                comm.send(torch.zeros(1000, dtype=torch.float32), 1)
            else:
                comm.recv(torch.empty(999, dtype=torch.float32), 0)
            res.append("no error")
        except pz.MismatchError:
            res.append("mismatch")
        t = empty(5000, dtype=torch.bfloat16)
        comm.recv(t, 2)
        res.append(same(t, data(seed, 2, rank, 5000, torch.bfloat16)))
    else:
        for peer in (0, 1):
            comm.send(data(seed, 2, peer, 5000, torch.bfloat16), peer)
        res.append("sent")
    return res


def gpu_path_and_kv(rank, world, seed, mode):
    """GPU ranks over the fabric (two may share one GPU): the point-to-point
    path with CUDA tensors (rings of odd sizes, a tensor cut into pieces,
    fp8), then KV blocks from CUDA caches into CUDA caches; every byte checked."""
    import kv_workers as kw
    from portable_zip.kv import KVLayer, KVReceiver, KVSender

    dev = torch.device("cuda", 0)
    comm = pz.Communicator(compress=mode, transport="fabric", device=dev, timeout=120)
    peer, n_ok = 1 - rank, 0
    for k, (n, dt) in enumerate([(0, torch.bfloat16), (7, torch.float16), (200_003, torch.bfloat16),
                                 (1_000_001, torch.float8_e4m3fn), (3 << 20, torch.bfloat16)]):
        mine, got = data(seed, rank, k, n, dt).to(dev), torch.empty(n, dtype=dt, device=dev)
        for w in (comm.isend(mine, peer), comm.irecv(got, peer)):
            w.wait()
        check(same(got, data(seed, peer, k, n, dt).to(dev)), f"ring {n} {dt}")
        n_ok += 1
    ids = {0: [5, 1, 9, 3, 7], 1: [2, 8, 0, 6, 4]}
    kv = [KVLayer(kv=lay.kv.to(dev)) for lay in kw.caches(seed, "prefill", torch.bfloat16, True)]
    if rank == 0:
        tx = KVSender(comm, [1])
        tx.send("r0", 1, kv, ids[0]).wait()
        tx.close()
    else:
        rx = KVReceiver(comm, [0])
        mine = [KVLayer(kv=lay.kv.to(dev)) for lay in kw.caches(seed, "decode", torch.bfloat16, True)]
        before = [lay.kv.clone() for lay in mine]
        rx.recv("r0", 0, mine, ids[1]).wait()
        for lay, b, src in zip(mine, before, kv):
            check(same(lay.kv[:, ids[1]], src.kv[:, ids[0]]), "kv blocks")
            keep = [i for i in range(lay.kv.shape[1]) if i not in ids[1]]
            check(same(lay.kv[:, keep], b[:, keep]), "kv: nothing outside the named blocks")
        rx.close()
        n_ok += 1
    st = comm.stats
    comm.close()
    return n_ok, {op: dict(s["plans"]) for op, s in st.items() if op in ("send", "recv")}


def _receive_all(comm, seed, cases, n, dtype):
    """Rank 1's side of a run of rank 0's messages: each lands exactly."""
    for case in range(cases):
        t = empty(n, dtype=dtype)
        comm.recv(t, 0)
        check(same(t, data(seed, 0, case, n, dtype)), f"message {case} landed wrong")
    comm.close()
    return "received"


def _send_all(comm, seed, cases, n, dtype):
    """Rank 0's run of messages to rank 1, one at a time: the plan each went by, in order."""
    plans = []
    for case in range(cases):
        before = dict(comm.stats.get("send", {}).get("plans", {}))
        comm.send(data(seed, 0, case, n, dtype), 1)
        after = comm.stats["send"]["plans"]
        plans.append(next(p for p in after if after[p] != before.get(p, 0)))
    return plans


def link_seen(rank, world, seed):
    """Point-to-point plans are the sender's alone, so under auto the sender
    judges a pair by how its raw messages ran, as the receiver timed their
    arrival: rank 0's link, claimed at 1 Gbit/s, runs 10x slower (its
    transport posts each payload 10x the predicted time after its frame),
    and after a run of such raw sends (LinkSeen.RUN) its messages go
    compressed; every message lands exactly. Returns rank 0's plans in order
    and its factor for rank 1."""
    comm = pz.Communicator(compress="auto", timeout=60, link_gbps=1, latency_us=50, codec_gbps=4)
    bf = torch.bfloat16
    n = LinkSeen.MIN_BYTES // 2  # bf16 elements: smaller messages are not observed
    while not (comm.policy.choose("send", bf, 2 * n, world) == "native" and comm.policy.send_pays(bf, 2 * n, 4.0)):
        n *= 2
        check(n < 1 << 26, "no message size that the link's being 4x slower turns compressed")
    cases = LinkSeen.RUN + 7
    if rank == 1:
        return _receive_all(comm, seed, cases, n, bf)
    predicted = comm.policy.predict("send", bf, 2 * n, world)[0]
    tp = comm._p2p.tps[0]
    real = tp.post

    def slow(ops):  # the payload leaves after its frame as late as a link ten times slower would make it land
        frames = [op for op in ops if op[1].numel() < n]
        payloads = [op for op in ops if op[1].numel() >= n]
        if not payloads:
            return real(ops)
        works = real(frames)
        time.sleep(10 * predicted)
        return works + real(payloads)
    tp.post = slow
    try:
        plans = _send_all(comm, seed, cases, n, bf)
    finally:
        tp.post = real
    factor = comm._seen.factor(1)
    comm.close()
    return plans, factor


def coded_seen(rank, world, seed):
    """Under auto a sender also judges compressing to a peer by how its
    compressed messages ran against their prediction: rank 0's
    codec is made slow (each encode first sleeps ten raw predictions), so
    after a run of such messages (CodedSeen.RUN) its messages of that size go
    raw, and once raw has run a while compression is tried again; every
    message lands exactly. The link is judged as calibrated here (LinkSeen
    learns nothing), so only the codec's misjudgement moves the plans.
    Returns rank 0's plans in order and its factor for that size."""
    from portable_zip.comm import p2p as p2p_mod
    from portable_zip.comm.observed import CodedSeen
    comm = pz.Communicator(compress="auto", timeout=60, link_gbps=1, latency_us=50, codec_gbps=40)
    bf = torch.bfloat16
    n = CodedSeen.MIN_BYTES // 2  # bf16 elements: smaller messages are not observed
    # A size the model compresses even 1.2x slower than predicted: raw's turn ends within the run below.
    while not (comm.policy.choose("send", bf, 2 * n, world) == "compressed"
               and comm.policy.send_pays(bf, 2 * n, 1.0, False, 1.2)):
        n *= 2
        check(n < 1 << 26, "no message size the model compresses")
    cases = CodedSeen.RUN + 120
    if rank == 1:
        return _receive_all(comm, seed, cases, n, bf)
    comm._seen.raw = lambda *args: None
    predicted = comm.policy.predict("send", bf, 2 * n, world)[0]
    real = p2p_mod._Peer._encode

    def slow(self, piece, sms):
        time.sleep(10 * predicted)
        return real(self, piece, sms)
    p2p_mod._Peer._encode = slow
    try:
        plans = _send_all(comm, seed, cases, n, bf)
    finally:
        p2p_mod._Peer._encode = real
    factor = comm._coded_seen.factor(1, bf, 2 * n)
    comm.close()
    return plans, factor
