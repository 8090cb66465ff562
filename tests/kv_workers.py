"""Per-rank bodies of the portable_zip.kv tests (importable by forked ranks).

Rank 0 prefills; its caches are random bits drawn from (seed, "prefill",
layer), so every decode rank rebuilds them and checks its own blocks bit for
bit. A decode rank's caches start as random bits of its own (seed, rank):
sentinels that every block outside the named ones must keep. The test's
torch.distributed world (gloo) carries only the tests' own signals; the KV
streams run on a pz.Communicator."""
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import portable_zip as pz
from portable_zip.kv import KVIntegrityError, KVLayer, KVMismatchError, KVReceiver, KVSender, KVTransferError
from portable_zip.kv import sender as kv_sender

NB, BS, HEADS, HD, LAYERS = 12, 4, 2, 8, 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def bits(seed, tag, shape, dtype):
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    rng = np.random.default_rng([seed] + [sum(map(ord, str(t))) * 7919 + i for i, t in enumerate(tag)])
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)).view(dtype).reshape(shape)


def caches(seed, who, dtype, fused, layers=LAYERS, nb=NB):
    """One cache per layer, fused or split, fp8 ones with scales."""
    out = []
    for l in range(layers):
        kv = bits(seed, (who, "kv", l, str(dtype)), (2, nb, BS, HEADS, HD), dtype)
        sc = {}
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            sc = {"k_scale": torch.rand(1, generator=torch.Generator().manual_seed(seed + l + 17 * len(who))),
                  "v_scale": torch.rand(1, generator=torch.Generator().manual_seed(seed + l + 31 * len(who)))}
        out.append(KVLayer(kv=kv, **sc) if fused else KVLayer(k=kv[0].clone(), v=kv[1].clone(), **sc))
    return out


def fused_view(lay):
    return lay.kv if lay.kv is not None else torch.stack([lay.k, lay.v])


def same(a, b):
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def check(mine, before, theirs, dst_ids, src_ids, what):
    """dst_ids of mine hold src_ids of theirs; every other block is as before; scales match."""
    for l, (m, b, t) in enumerate(zip(mine, before, theirs)):
        m, b, t = fused_view(m), fused_view(b), fused_view(t)
        for d, s in zip(dst_ids, src_ids):
            assert same(m[:, d], t[:, s]), f"{what}: layer {l} block {d} != prefill block {s}"
        rest = [i for i in range(m.shape[1]) if i not in set(dst_ids)]
        assert same(m[:, rest], b[:, rest]), f"{what}: layer {l}: a block outside {dst_ids} was written"
    for l, (m, t) in enumerate(zip(mine, theirs)):
        for name in ("k_scale", "v_scale"):
            if getattr(t, name) is not None:
                assert same(getattr(m, name), getattr(t, name)), f"{what}: layer {l} {name} differs"


def snapshot(layers):
    return [KVLayer(kv=fused_view(l).clone()) for l in layers]


def comm(mode, timeout=30.0):
    return pz.Communicator(compress=mode, timeout=timeout)


def plans(c):
    """What the Communicator moved, per op: calls and plans (raw, compressed, native)."""
    return {op: {"calls": s["calls"], "plans": s["plans"]} for op, s in c.stats.items()}


def roundtrip(rank, world, seed, mode):
    """Every dtype, fused -> split and split -> fused, non-contiguous and
    different block ids; then layer-by-layer waits with the receiver first."""
    c = comm(mode)
    src_ids, dst_ids = [7, 2, 9, 4, 0], [3, 11, 1, 8, 5]
    jobs = [(name, fused) for name in DTYPES for fused in (True, False)]
    if rank == 0:
        tx = KVSender(c, [1])
        handles = [tx.send(f"rt-{name}-{fused}", 1, caches(seed, "prefill", DTYPES[name], fused), src_ids)
                   for name, fused in jobs]
        for h in handles:
            h.wait()
        # Layer by layer: layer l+1 leaves only once the receiver saw layer l alone.
        kv = caches(seed, "prefill", torch.bfloat16, True)
        h = tx.start("layered", 1, LAYERS)
        for l in range(LAYERS):
            tx.send_layer("layered", l, kv[l], src_ids)
            if l < LAYERS - 1:
                dist.recv(torch.zeros(1), 1)
        h.wait()
        tx.close()
        out = plans(c)
    else:
        rx = KVReceiver(c, [0])
        for name, fused in jobs:
            mine = caches(seed, f"decode{rank}", DTYPES[name], not fused)
            before = snapshot(mine)
            rx.recv(f"rt-{name}-{fused}", 0, mine, dst_ids).wait()
            check(mine, before, caches(seed, "prefill", DTYPES[name], fused), dst_ids, src_ids, f"{name} {fused}")
        mine = caches(seed, f"decode{rank}", torch.bfloat16, False)
        before = snapshot(mine)
        h = rx.recv("layered", 0, mine, dst_ids)
        theirs = caches(seed, "prefill", torch.bfloat16, True)
        for l in range(LAYERS):
            h.wait(layer=l)
            check(mine[:l + 1], before[:l + 1], theirs[:l + 1], dst_ids, src_ids, f"layered {l}")
            assert not h.done() if l < LAYERS - 1 else h.done(), f"layer {l}: done() = {h.done()}"
            if l < LAYERS - 1:
                assert same(fused_view(mine[l + 1]), fused_view(before[l + 1])), f"layer {l + 1} landed early"
                dist.send(torch.zeros(1), 0)
        h.wait()
        rx.close()
        out = plans(c)
    c.close()
    return out


def fanout(rank, world, seed, mode):
    """Rank 0 to every other rank, two requests each, their layers interleaved;
    each decode registers one request before the data and one after."""
    c = comm(mode)
    reqs = [(f"req-{d}-{j}", d, j) for j in range(2) for d in range(1, world)]
    src = {rid: [(3 * j + 5 * d + i) % NB for i in range(4 + j)] for rid, d, j in reqs}
    dst = {rid: [(NB - 1 - 2 * i - j) % NB for i in range(4 + j)] for rid, d, j in reqs}
    dtype = torch.bfloat16
    if rank == 0:
        tx = KVSender(c, range(1, world))
        dist.barrier()  # j == 0 requests are registered on the decodes
        kv = caches(seed, "prefill", dtype, True)
        handles = [tx.start(rid, d, LAYERS) for rid, d, j in reqs]
        for l in range(LAYERS):
            for rid, d, j in reqs:
                tx.send_layer(rid, l, kv[l], src[rid])
        for h in handles:
            h.wait()
        dist.barrier()
        tx.close()
    else:
        rx = KVReceiver(c, [0])
        mine = {rid: caches(seed, f"decode{rank}-{rid}", dtype, False) for rid, d, j in reqs if d == rank}
        before = {rid: snapshot(v) for rid, v in mine.items()}
        hs = {rid: rx.recv(rid, 0, mine[rid], dst[rid]) for rid, d, j in reqs if d == rank and j == 0}
        dist.barrier()
        dist.barrier()  # everything sent: the j == 1 requests were parked
        hs.update({rid: rx.recv(rid, 0, mine[rid], dst[rid]) for rid, d, j in reqs if d == rank and j == 1})
        theirs = caches(seed, "prefill", dtype, True)
        for rid, h in hs.items():
            h.wait()
            check(mine[rid], before[rid], theirs, dst[rid], src[rid], rid)
        rx.close()
    out = plans(c)
    c.close()
    return out


def misuse(rank, world, seed):
    """Unknown, duplicate and finished ids raise on both sides; a corrupted
    payload and a forged descriptor fail their request, nothing written, and
    the stream goes on."""
    c = comm("always")
    ids = [1, 6, 3]
    errs = {}

    def expect(name, exc, fn):
        try:
            fn()
        except exc as e:
            errs[name] = f"{type(e).__name__}: {e}"
            return
        raise AssertionError(f"{name}: no {exc.__name__}")

    if rank == 0:
        tx = KVSender(c, [1])
        kv = caches(seed, "prefill", torch.bfloat16, True)
        expect("send_layer unknown", KeyError, lambda: tx.send_layer("nope", 0, kv[0], ids))
        expect("handle unknown", KeyError, lambda: tx.handle("nope"))
        tx.send("good", 1, kv, ids).wait()
        expect("start finished", ValueError, lambda: tx.start("good", 1, LAYERS))
        expect("send_layer finished", ValueError, lambda: tx.send_layer("good", 0, kv[0], ids))
        dup = tx.start("dup", 1, LAYERS)
        expect("start duplicate", ValueError, lambda: tx.start("dup", 1, LAYERS))
        expect("bad dst", ValueError, lambda: tx.start("x", 0, LAYERS))
        expect("bad layer", ValueError, lambda: tx.send_layer("dup", LAYERS, kv[0], ids))
        expect("bad block id", ValueError, lambda: tx.send_layer("dup", 0, kv[0], [NB]))
        tx.abort("dup")
        expect("aborted wait", KVTransferError, dup.wait)
        expect("aborted handle", KVTransferError, lambda: tx.handle("dup"))

        def flip(desc, payload):
            payload.view(torch.uint8).reshape(-1)[5] ^= 0x10
        kv_sender.tamper = flip
        tx.send("corrupt", 1, kv[:1], ids).wait()

        def forge(desc, payload):
            desc[4] = 7  # layer 7 of a 3-layer request
        kv_sender.tamper = forge
        tx.send("forged", 1, kv[:1], ids).wait()
        kv_sender.tamper = None
        tx.send("after", 1, kv, ids).wait()
        tx.close()
    else:
        rx = KVReceiver(c, [0])
        theirs = caches(seed, "prefill", torch.bfloat16, True)
        mine = caches(seed, "decode", torch.bfloat16, True)
        before = snapshot(mine)
        h = rx.recv("good", 0, mine, [2, 9, 4])
        expect("recv duplicate", ValueError, lambda: rx.recv("good", 0, mine, [2, 9, 4]))
        h.wait()
        check(mine, before, theirs, [2, 9, 4], ids, "good")
        expect("recv finished", ValueError, lambda: rx.recv("good", 0, mine, [2, 9, 4]))
        expect("handle unknown", KeyError, lambda: rx.handle("nope"))
        expect("recv bad source", KeyError, lambda: rx.recv("z", 1, mine, [0]))
        expect("recv repeated block", ValueError, lambda: rx.recv("z", 0, mine, [0, 0]))
        expect("dup aborted", KVTransferError, lambda: rx.recv("dup", 0, mine, [0, 1, 5]).wait(timeout=20))
        one = caches(seed, "decode1", torch.bfloat16, True, layers=1)
        one_before = snapshot(one)
        expect("corrupt", KVIntegrityError, lambda: rx.recv("corrupt", 0, one, [0, 1, 5]).wait(timeout=20))
        assert same(one[0].kv, one_before[0].kv), "a corrupted payload was written"
        expect("forged", KVMismatchError, lambda: rx.recv("forged", 0, one, [0, 7, 5]).wait(timeout=20))
        assert same(one[0].kv, one_before[0].kv), "a forged descriptor's payload was written"
        mine = caches(seed, "decode2", torch.bfloat16, True)
        before = snapshot(mine)
        rx.recv("after", 0, mine, [10, 0, 8]).wait(timeout=20)
        check(mine, before, theirs, [10, 0, 8], ids, "after")
        rx.close()
    c.close()
    return errs


def killed(rank, world, seed):
    """The decode rank dies once it has layer 0; the prefill's next layers
    raise, naming the request, within seconds."""
    c = comm("always", timeout=30.0)
    kv = [KVLayer(kv=torch.randn(2, 64, 16, 8, 64).to(torch.bfloat16)) for _ in range(4)]
    ids = list(range(0, 64, 2))
    if rank == 1:
        rx = KVReceiver(c, [0])
        mine = [KVLayer(kv=torch.zeros(2, 64, 16, 8, 64, dtype=torch.bfloat16)) for _ in range(4)]
        rx.recv("doomed", 0, mine, ids).wait(layer=0)
        os._exit(0)
    tx = KVSender(c, [1])
    h = tx.start("doomed", 1, 4)
    tx.send_layer("doomed", 0, kv[0], ids)
    time.sleep(1.0)  # the decode rank is gone by now
    t0 = time.monotonic()
    err = None
    try:
        for l in range(1, 4):
            tx.send_layer("doomed", l, kv[l], ids)
            time.sleep(0.05)
        h.wait(timeout=60)
    except (KeyError, ValueError):
        raise
    except pz.PeerError as e:
        err = e
    took = time.monotonic() - t0
    t1 = time.monotonic()
    tx.close()
    return (type(err).__name__ if err else None, isinstance(err, pz.PeerError), getattr(err, "request_id", None),
            str(err)[:400], took, time.monotonic() - t1)


def vllm_flow(rank, world, seed):
    """P1D3 through the vLLM stand-in: rank 0 prefills six requests (one
    prompt spans three scheduler steps) and hands each decode instance its
    requests' kv_transfer_params, as the proxy would; each decode loads them
    asynchronously and its caches must hold the prefill's bytes for every
    prompt token it did not compute itself."""
    import fake_vllm_kv as fv
    fv.install()
    role = "kv_producer" if rank == 0 else "kv_consumer"
    cfg = fv.VllmConfig(fv.KVTransferConfig(
        kv_connector="PzKVConnector", kv_connector_module_path="portable_zip.kv.vllm", kv_role=role, kv_rank=rank,
        kv_parallel_size=world, kv_connector_extra_config={
            "pz_prefill_ranks": [0], "pz_decode_ranks": list(range(1, world)), "pz_compress": "always",
            "pz_timeout": 30}), fv.CacheConfig(block_size=4))
    eng = fv.Engine(cfg, seed, token_budget=24)
    rng = np.random.default_rng(seed)
    lens = [5, 17, 60, 9, 33, 24]
    prompts = [rng.integers(0, 32000, n).tolist() for n in lens]
    if rank == 0:
        for i, p in enumerate(prompts):
            eng.add_request(fv.Request(f"p{i}", p, 1, {"do_remote_decode": True, "pz_decode_rank": 1 + i % 3,
                                                       "pz_transfer_id": f"x{seed}-{i}"}))
        for _ in range(100):
            if not eng.requests:
                break
            eng.step()
        done = {int(r.request_id[1:]): r for r in eng.finished}
        assert sorted(done) == list(range(len(prompts))), sorted(done)
        steps = [done[i].steps for i in range(len(prompts))]
        handoff = [[done[i].out_params for i in range(len(prompts))],
                   {i: eng.request_kv(done[i], lens[i]) for i in done}]
    else:
        handoff = [None, None]
    dist.broadcast_object_list(handoff, src=0)
    params, kv = handoff
    if rank == 0:
        eng.worker.shutdown()
        return steps
    mine = [i for i in range(len(prompts)) if 1 + i % 3 == rank]
    for i in mine:
        assert params[i]["do_remote_prefill"] and params[i]["pz_prefill_rank"] == 0, params[i]
        eng.add_request(fv.Request(f"d{i}", prompts[i], 3, params[i]))
    end = time.monotonic() + 30
    while eng.requests and time.monotonic() < end:
        eng.step()
        time.sleep(0.002)
    assert not eng.requests, [(r.request_id, r.status) for r in eng.requests]
    out = {}
    for r in eng.finished:
        i = int(r.request_id[1:])
        got = eng.request_kv(r, lens[i])
        assert same(got, kv[i]), f"request {i}: decode cache != prefill cache"
        out[i] = r.computed_here
    eng.worker.shutdown()
    return out
