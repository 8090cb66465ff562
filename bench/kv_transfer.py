"""KV-cache transfer (prefill -> decode disaggregation), in Llama-3.1-8B's
shapes: 32 layers, 8 KV heads of 128, 16-token blocks.

    python bench/kv_transfer.py [--tokens 8192] [--link nvlink-1ch] [--json out.json]
        rank 0 sends one prompt's KV (every layer's K and V as one batch) to
        rank 1 on a local link: torch.distributed's batch_isend_irecv vs ours.
    python -P bench/kv_transfer.py --link netns --gbit 1 [--device cpu|cuda] [--tokens 512,2048,8192]
        portable_zip.kv between two network namespaces over a shaped link
        (root; portable_zip/netns.py), real KV (bench/pzbench/real_kv.py,
        --data synthetic otherwise): a prompt's paged blocks, whole (decode's
        wait from the first post to the last layer landed) under
        compress=never, always and auto, each against the link's limit (its
        bytes at plain TCP's measured rate); then layer pipelining: prefill
        posts layer l after computing it (a sleep of one layer's raw wire
        time), and the decode side notes when the last layer lands after the
        last layer was computed (both clocks are this host's monotonic one).
        --decodes 3: one prefill host to three decode hosts (P1D3), each
        decode its own request at once; a run's time is the slowest
        decode's, against the prefill link's limit for all their bytes.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench import comm as comm_bench  # noqa: E402
from pzbench.common import report  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def kv_cache(tokens, device):
    """K and V per layer as [blocks, block_size, kv_heads, head_dim] bf16, with
    per-channel scales (a few outlier channels in K) like real activations."""
    g = torch.Generator(device="cpu").manual_seed(0)
    blocks = tokens // BLOCK
    out = []
    for _ in range(LAYERS):
        k_scale = torch.exp(torch.randn(KV_HEADS, HEAD_DIM, generator=g) * 0.8)
        v_scale = torch.exp(torch.randn(KV_HEADS, HEAD_DIM, generator=g) * 0.3) * 0.5
        k = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g) * k_scale
        v = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g) * v_scale
        out += [k.to(torch.bfloat16).to(device), v.to(torch.bfloat16).to(device)]
    return out


def worker(rank, world, tokens, reps):
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    kv = kv_cache(tokens, device)
    result = {"tokens": tokens, "bytes": sum(t.nbytes for t in kv), "tensors": len(kv)}
    result.update(comm_bench.p2p_modes(rank, kv, reps))
    return result


def paged(tokens, data, dtype, device):
    """Every layer's [2, blocks, 16, 8, 128] cache: real KV tiled (pzbench.real_kv), or kv_cache()'s."""
    if data == "real":
        from pzbench import real_kv
        why = real_kv.missing()
        if why:
            raise SystemExit(f"bench/kv_transfer.py: no real KV here: {why}")
        layers, _ = real_kv.paged_cache(tokens, dtype, layers=LAYERS, device=str(device))
        return layers
    kv = kv_cache(tokens, device)
    return [torch.stack([kv[2 * i], kv[2 * i + 1]]) for i in range(LAYERS)]


def link_worker(spec: str) -> None:
    """One rank on the shaped link: rank 0 the prefill (KVSender), ranks 1.. the decodes (KVReceiver),
    each its own request."""
    from datetime import timedelta

    import portable_zip as pz
    from portable_zip import netns
    from portable_zip.kv import KVLayer, KVReceiver, KVSender

    a = json.loads(spec)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=1800))
    rank = dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    device = torch.device("cuda", 0) if a["device"] == "cuda" else torch.device("cpu")
    transport = "fabric" if a["device"] == "cuda" else "torch"
    out = {"rows": []}
    for tokens in a["tokens"]:
        kv = paged(tokens, a["data"], a["dtype"], device)
        nbytes = sum(t.nbytes for t in kv)
        blocks = kv[0].shape[1]
        g = torch.Generator().manual_seed(tokens)
        ids = {0: torch.randperm(blocks, generator=g).tolist(), 1: torch.randperm(blocks + 7, generator=g)[:blocks].tolist()}
        decodes = list(range(1, dist.get_world_size()))
        mine = kv if rank == 0 else [torch.empty(2, blocks + 7, *t.shape[2:], dtype=t.dtype, device=device) for t in kv]
        layers = [KVLayer(kv=t) for t in mine]
        want = paged(tokens, a["data"], a["dtype"], device) if rank else None
        # Every mode's sender and receiver at once, and the reps interleaved (mode by mode within a rep): a
        # drift of the host or the link lands on every mode alike, not on whichever ran last.
        comms = {m: pz.Communicator(compress=m, transport=transport, device=device, timeout=900) for m in a["modes"]}
        sides = {m: KVSender(c, decodes) if rank == 0 else KVReceiver(c, [0]) for m, c in comms.items()}
        times = {m: [] for m in a["modes"]}
        modes = list(sides)
        for rep in range(a["reps"] + 1):  # the first one warms up (and auto's policy sees the link)
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:  # each mode first in turn
                side = sides[mode]
                rid = f"t{tokens}-{mode}-{rep}"
                if rank:
                    for t in mine:  # each transfer must bring every block itself
                        t.zero_()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    for h in [side.send(f"{rid}-{d}", d, layers, ids[0]) for d in decodes]:
                        h.wait()
                else:
                    side.recv(f"{rid}-{rank}", 0, layers, ids[1]).wait()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                if rep:
                    times[mode].append(time.perf_counter() - t0)
                if rank:  # the decode's blocks equal the prefill's, bit for bit
                    for t, w in zip(mine, want):
                        if not torch.equal(t[:, ids[1]].view(torch.uint8), w[:, ids[0]].view(torch.uint8)):
                            raise AssertionError(f"{tokens} tokens, {mode}, rep {rep}: the decode's blocks differ")
        for mode, side in sides.items():
            comm = comms[mode]
            row = {"tokens": tokens, "mode": mode, "bytes": nbytes, "seconds": statistics.median(times[mode]),
                   "seconds_all": times[mode], "plans": {op: dict(st["plans"]) for op, st in comm.stats.items()
                                                         if op in ("send", "recv")}}
            if a["pipelined"] and tokens == max(a["tokens"]) and len(decodes) == 1:
                row["pipelined"] = pipelined(rank, side, layers, ids, a["layer_s"].get(str(tokens), 0.0), mode)
            side.close()
            comm.close()
            out["rows"].append(row)
        del sides, comms, want
    dist.barrier()
    dist.destroy_process_group()
    netns.report({"rank": rank, "result": out})


def pipelined(rank, side, layers, ids, layer_s, mode):
    """Prefill computes layer l (a sleep of layer_s) and posts it at once; the
    decode waits layer by layer. Returns each side's monotonic times."""
    rid = f"pipe-{mode}"
    dist.barrier()
    if rank == 0:
        h = side.start(rid, 1, len(layers))
        posted = []
        for l, lay in enumerate(layers):
            time.sleep(layer_s)
            side.send_layer(rid, l, lay, ids[0])
            posted.append(time.monotonic())
        h.wait()
        return {"computed_end": posted[-1], "layer_s": layer_s}
    h = side.recv(rid, 0, layers, ids[1])
    landed = []
    for l in range(len(layers)):
        h.wait(layer=l)
        landed.append(time.monotonic())
    return {"landed": landed}


def netns_main(a) -> None:
    from netns_link import on_link

    from portable_zip import netns
    why = netns.unavailable()
    if why:
        sys.exit(f"bench/kv_transfer.py: no shaped link here: {why}")
    tokens = [int(t) for t in str(a.tokens).split(",")]
    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * (2 if a.dtype == "bf16" else 1)
    layer_s = {str(t): 8 * per_token * t / LAYERS / (a.gbit * 1e9) for t in tokens}  # one layer's raw wire time
    spec = json.dumps({"tokens": tokens, "modes": a.modes.split(","), "reps": a.reps, "device": a.device,
                       "data": a.data, "dtype": a.dtype, "pipelined": not a.no_pipeline, "layer_s": layer_s})
    desc, limit, ranks = on_link(a.gbit, [sys.executable, "-P", os.path.abspath(__file__), "--link-worker", spec],
                                 hosts=1 + a.decodes, timeout=3000)
    rows = {(r["tokens"], r["mode"]): r for r in ranks[1]["result"]["rows"]}
    for (tokens, mode), r in rows.items():  # a run ends when its slowest decode has every layer
        per = [next(x for x in rk["result"]["rows"] if (x["tokens"], x["mode"]) == (tokens, mode))["seconds_all"]
               for rk in ranks[1:]]
        r["seconds_all"] = [max(t) for t in zip(*per)]
        r["seconds"] = statistics.median(r["seconds_all"])
    table = []
    for (tokens, mode), r in sorted(rows.items()):
        limit_s = 8 * a.decodes * r["bytes"] / (limit["gbit"] * 1e9)  # every decode's bytes leave the prefill's link
        raw = rows.get((tokens, "never"))
        line = {"tokens": tokens, "mode": mode, "MiB": r["bytes"] / 2**20, "seconds": r["seconds"],
                "seconds_all": r["seconds_all"],  # each rep: the spread says what a gap between modes means
                "x_vs_never": raw["seconds"] / r["seconds"] if raw else None, "x_vs_link_limit": limit_s / r["seconds"],
                "plans": r["plans"]}
        if "pipelined" in r:
            sent = next(x for x in ranks[0]["result"]["rows"] if x["tokens"] == tokens and x["mode"] == mode)
            end, landed = sent["pipelined"]["computed_end"], r["pipelined"]["landed"]
            one_layer = r["seconds"] / LAYERS  # this mode's own per-layer transfer time
            line["pipelined"] = {"last_layer_after_compute_s": landed[-1] - end, "one_layer_transfer_s": one_layer,
                                 "within_one_layer": landed[-1] - end <= one_layer}
        table.append(line)
    res = {"link": desc, "limit": limit, "device": a.device, "data": a.data, "dtype": a.dtype, "decodes": a.decodes,
           "rows": table,
           "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK}}
    report(res, a.json)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8192", help="prompt length; netns: a comma list")
    p.add_argument("--link", default="nvlink-1ch", choices=sorted(comm_bench.LINKS) + ["netns"])
    p.add_argument("--gbit", type=float, default=1.0, help="--link netns: the link's rate")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="--link netns: the ranks' tensors")
    p.add_argument("--data", default="real", choices=["real", "synthetic"], help="--link netns: the KV")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp8_e4m3", "fp8_e5m2"], help="--link netns, real data")
    p.add_argument("--modes", default="never,always,auto")
    p.add_argument("--no-pipeline", action="store_true", help="--link netns: skip the layer-pipelining run")
    p.add_argument("--decodes", type=int, default=1, choices=range(1, 8), metavar="N",
                   help="--link netns: decode hosts, each its own request from the one prefill (3: P1D3)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--link-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.link_worker:
        return link_worker(a.link_worker)
    if a.link == "netns":
        return netns_main(a)
    res = comm_bench.spawn(2, worker, int(a.tokens), a.reps, env=comm_bench.LINKS[a.link])
    res["link"] = a.link
    report(res, a.json)


if __name__ == "__main__":
    main()
