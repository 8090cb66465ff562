"""The fabric transport between 2 local processes, beside the link's own limit
and what torch offers, on the same bf16 weight-like tensors (N(0, 0.02^2)):

  socket       plain TCP sockets on loopback (1, 2, 4 parallel streams; the best
               is the link's limit): host memory, Python, one kernel call per stream
  fabric raw   pz.Communicator(compress="never", transport="fabric"), per
               PZ_FABRIC_RAILS (1, 2, 4), PZ_FABRIC_PROVIDER="tcp;ofi_rxm"
  fabric always/auto
               the same with compress="always" / "auto", per rails value, side by
               side with raw on the same rails: one Communicator each in one pair of
               processes, their reps interleaved, so drift hits every mode alike
  gloo         torch.distributed send/recv over gloo on CPU tensors; GPU ranks
               also pay the copy to pinned host memory and back, as a GPU user would
  nccl socket  NCCL's socket transport over loopback (needs 2 GPUs: NCCL refuses
               two ranks on one GPU)

GB/s are input bytes per direction (rank 0 sends to rank 1) over the median
of reps of the slowest rank's time. Every fabric and gloo receive is checked
bit for bit against the sender's tensor.

Sections (any together, one JSON; none named: --p2p):
  --p2p           the table above
  --mixed         4 ranks, domains [[0,1],[2,3]] (ranks 0,1 on GPUs where there
                  are 2, else CPU), world backend gloo: all_reduce,
                  all_gather_single, broadcast, all_to_all_single through
                  pz.Communicator against gloo's own collectives on the same job
  --pair-domains  2 ranks each its own domain (transport="fabric"): all_reduce vs gloo's

    python bench/fabric.py --out FILE.json [--ranks-on cuda|cpu] [--sizes 1MiB,...] [--rails 1,2,4] [--quick]
"""
import argparse
import concurrent.futures
import hashlib
import json
import os
import socket
import statistics
import struct
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench import comm as comm_bench  # noqa: E402
from pzbench.common import fmt_size, machine_info, parse_size, print_table  # noqa: E402

NCCL_SOCKET = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo",
               "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}
SIZES = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB"
QUICK_SIZES = "1MiB,4MiB,16MiB,64MiB"
COLL_SIZES, QUICK_COLL_SIZES = "64MiB,256MiB", "16MiB,64MiB"
COLL_OPS = ("all_reduce", "all_gather", "broadcast", "all_to_all")
POISON = 7.0  # no N(0, 0.02^2) bf16 draw is this far out: an unwritten element shows


def reps_for(size: int, quick: bool) -> int:
    """About 512 MiB moved per timing (256 MiB with --quick), 5 to 20 reps."""
    return max(3 if quick else 5, min(20, -(-(256 if quick else 512) * 2**20 // size)))


def device_for(rank: int, on_cuda: bool) -> torch.device:
    """Ranks share the GPUs round-robin (one GPU: every rank on cuda:0)."""
    if not on_cuda:
        return torch.device("cpu")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def timed(fn, cuda: bool, reps: int, reset=None) -> float:
    """comm_bench.timed for a world whose ranks may hold GPU tensors under
    gloo: the median over reps of the slowest rank's seconds for fn() (GPU
    work synchronized), with reset() run untimed before each rep (all_reduce
    is in place)."""
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    times = []
    for _ in range(reps):
        if reset is not None:
            reset()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=on)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        times.append(el.item())
    return statistics.median(times)


def timed_each(fns: dict, cuda: bool, reps: int) -> dict:
    """timed() for several fns at once, their reps interleaved (each rep runs every fn once, starting
    one further along each time): {name: median seconds}."""
    names = list(fns)
    times = {k: [] for k in names}
    for rep in range(reps):
        for i in range(len(names)):
            k = names[(rep + i) % len(names)]
            times[k].append(timed(fns[k], cuda, 1))
    return {k: statistics.median(v) for k, v in times.items()}


# --- the link's limit: plain TCP sockets -------------------------------------------------------------------------
def _connect(rank: int, streams: int, key: str) -> list:
    """streams TCP connections from rank 0 to rank 1 on 127.0.0.1, in stream order."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        srv = socket.create_server(("127.0.0.1", 0), backlog=streams)
        store.set(key, str(srv.getsockname()[1]))
        socks = [None] * streams
        for _ in range(streams):
            s, _ = srv.accept()
            socks[struct.unpack("<I", _recv_exact(s, 4))[0]] = s
        srv.close()
    else:
        port = int(store.get(key))
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
        for i, s in enumerate(socks):
            s.sendall(struct.pack("<I", i))
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return socks


def _recv_exact(s, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(s, memoryview(buf))
    return bytes(buf)


def _recv_into(s, mv) -> None:
    """Fill mv: MSG_WAITALL makes it one kernel call, so Python costs nothing per byte."""
    got = 0
    while got < len(mv):
        k = s.recv_into(mv[got:], len(mv) - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("the socket closed mid-transfer")
        got += k


def socket_worker(rank, world, sizes, streams_list, quick):
    big = max(sizes)
    data = comm_bench.weights(big // 2, "cpu", seed=0).view(torch.uint8)
    buf = data if rank == 0 else torch.empty_like(data)
    mv = memoryview(buf.numpy())
    rows = []
    for streams in streams_list:
        socks = _connect(rank, streams, f"pz/bench/socket/{streams}")
        pool = concurrent.futures.ThreadPoolExecutor(streams) if streams > 1 else None
        for size in sizes:
            cuts = [size * i // streams for i in range(streams + 1)]

            def one(i, cuts=cuts):
                part = mv[cuts[i]:cuts[i + 1]]
                socks[i].sendall(part) if rank == 0 else _recv_into(socks[i], part)

            def move(one=one):
                if pool is None:
                    one(0)
                else:
                    list(pool.map(one, range(streams)))

            if rank == 1:
                buf[:size].fill_(0)
            move()  # warm-up
            ok = bool(torch.equal(buf[:size], data[:size]))
            sec = timed(move, False, reps_for(size, quick))
            rows.append({"bytes": size, "streams": streams, "GBps": size / sec / 1e9, "ms": sec * 1e3, "ok": ok})
        for s in socks:
            s.close()
        if pool is not None:
            pool.shutdown()
    return rows


# --- one-way transfers: fabric, gloo, NCCL -----------------------------------------------------------------------
def p2p_worker(rank, world, how, sizes, on_cuda, quick):
    """Rank 0 sends each size to rank 1. how: "fabric:<compress mode>[,<mode>...]", "gloo" or "nccl".
    Several fabric modes run side by side, one Communicator each, their reps interleaved (each rep
    times every mode once, in turn), so drift on the host hits them alike: {"modes": {mode: run}}."""
    if how == "nccl":
        dev = torch.device("cuda", rank)
    else:
        dev = device_for(rank, on_cuda)
    cuda = dev.type == "cuda"
    src = comm_bench.weights(max(sizes) // 2, dev, seed=0)  # both ranks: rank 1 checks against it
    dst = torch.empty_like(src)
    comms, host, meta = {None: None}, None, {None: {"device": str(dev)}}
    if how.startswith("fabric:"):
        import portable_zip as pz

        comms, meta = {}, {}
        for mode in how.split(":")[1].split(","):
            c = comms[mode] = pz.Communicator(compress=mode, transport="fabric", device=dev, timeout=120)
            meta[mode] = {"device": str(dev), "backend": c.backend, "info": dict(c.tp.info)}
            if c.policy.cal is not None:
                meta[mode]["calibration"] = c.policy.cal.describe()
    elif how == "gloo" and cuda:  # what a GPU user of gloo does: pinned host buffers, copies both ways
        host = torch.empty(src.numel(), dtype=src.dtype, pin_memory=True)
    rows = {m: [] for m in comms}
    for size in sizes:
        n = size // 2
        a, b = src[:n], dst[:n]
        h = host[:n] if host is not None else None

        def mover(comm):
            def move():
                if comm is not None:
                    comm.send(a, 1) if rank == 0 else comm.recv(b, 0)
                elif h is None:
                    dist.send(a, 1) if rank == 0 else dist.recv(b, 0)
                elif rank == 0:
                    h.copy_(a)
                    dist.send(h, 1)
                else:
                    dist.recv(h, 0)
                    b.copy_(h)
            return move

        moves = {m: mover(c) for m, c in comms.items()}
        before, got = {}, {}
        for m, c in comms.items():
            before[m] = {**c.stats.get("send", {})} if c is not None else {}
            b.fill_(POISON)
            moves[m]()  # warm-up, and the transfer that is checked
            if cuda:
                torch.cuda.synchronize()
            got[m] = bool(torch.equal(a.view(torch.int16), b.view(torch.int16))) if rank == 1 else None
        secs = timed_each(moves, cuda, reps_for(size, quick))
        for m, c in comms.items():
            row = {"bytes": size, "ok": got[m], "ms": secs[m] * 1e3, "GBps": size / secs[m] / 1e9}
            if c is not None and rank == 0:
                st, plans = c.stats["send"], before[m].get("plans", {})
                row["plan"] = "/".join(p for p in st["plans"] if st["plans"][p] > plans.get(p, 0)) or "-"
                raw = st["raw_bytes"] - before[m].get("raw_bytes", 0)
                row["ratio"] = (st["wire_bytes"] - before[m].get("wire_bytes", 0)) / raw if raw else 1.0
                if c.policy.cal is not None:  # what auto's cost model expected of each plan (ms)
                    native, coded = c.policy.predict("send", src.dtype, size, 2)
                    row["predicted_ms"] = {"raw": native * 1e3, "compressed": coded * 1e3}
            rows[m].append(row)
    for c in comms.values():
        if c is not None:
            c.close()
    if None in comms:
        return {"rows": rows[None], **meta[None]}
    return {"modes": {m: {"rows": rows[m], "interleaved": len(comms) > 1, **meta[m]} for m in comms}}


# --- collectives across domains ----------------------------------------------------------------------------------
def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def coll_worker(rank, world, layout, sizes, ops, modes, quick):
    """Each op through pz.Communicator (per compress mode) and through gloo's
    own collective on the world group (GPU ranks via pinned host copies).
    Returns this rank's times and checks; the parent merges the ranks."""
    import portable_zip as pz

    dev = device_for(rank, rank in layout["gpu_ranks"])
    cuda = dev.type == "cuda"
    comms = {m: pz.Communicator(compress=m, transport=layout["transport"], domains=layout["domains"], device=dev,
                                timeout=120) for m in modes}
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    meta = {"device": str(dev), "backend": comms[modes[0]].backend}
    rows = []
    for size in sizes:
        n = size // 2
        src = comm_bench.weights(n, dev, seed=rank)
        for op in ops:
            row = {"op": op, "bytes": size}
            if op in ("all_reduce", "broadcast"):  # in place: each rep starts from src again
                inp, out = src.clone(), None
                reset = lambda inp=inp, src=src: inp.copy_(src)  # noqa: E731
            else:
                inp = src
                out = torch.empty((world if op == "all_gather" else 1) * n, dtype=src.dtype, device=dev)
                reset = None
            result = out if out is not None else inp
            hin = torch.empty(inp.numel(), dtype=src.dtype, pin_memory=True) if cuda else inp
            hout = (torch.empty(out.numel(), dtype=src.dtype, pin_memory=True) if cuda else out) \
                if out is not None else None

            def gloo(op=op, inp=inp, out=out, hin=hin, hout=hout):
                if cuda and (op != "broadcast" or rank == 0):
                    hin.copy_(inp)
                if op == "all_reduce":
                    dist.all_reduce(hin)
                elif op == "broadcast":
                    dist.broadcast(hin, 0)
                elif op == "all_gather":
                    ag(hout, hin)
                else:
                    dist.all_to_all_single(hout, hin)
                if cuda and out is not None:
                    out.copy_(hout)
                elif cuda and (op != "broadcast" or rank != 0):
                    inp.copy_(hin)

            variants = {"gloo": gloo}
            for mode, comm in comms.items():
                def ours(op=op, inp=inp, out=out, comm=comm):
                    if op == "all_reduce":
                        comm.all_reduce(inp)
                    elif op == "broadcast":
                        comm.broadcast(inp, 0)
                    elif op == "all_gather":
                        comm.all_gather_single(out, inp)
                    else:
                        comm.all_to_all_single(out, inp)
                variants[mode] = ours
            got = {}
            for name, fn in variants.items():
                before = dict(comms[name].stats.get(op, {}).get("plans", {})) if name in comms else {}
                if reset is not None:
                    reset()
                if out is not None or (op == "broadcast" and rank != 0):
                    result.fill_(POISON)
                fn()  # warm-up, and the result that is checked
                if cuda:
                    torch.cuda.synchronize()
                got[name] = result.clone()
                sec = timed(fn, cuda, 3 if quick else 5, reset)
                row[f"{name}_ms"] = sec * 1e3
                row[f"{name}_GBps"] = size / sec / 1e9
                if name in comms:
                    after = comms[name].stats.get(op, {}).get("plans", {})
                    row[f"{name}_plan"] = "/".join(p for p in after if after[p] > before.get(p, 0)) or "-"
            ref = got["gloo"]
            for name in comms:
                mine = got[name]
                row[f"{name}_exact"] = bool(torch.equal(mine.view(torch.int16), ref.view(torch.int16)))
                if op == "all_reduce":
                    row[f"{name}_maxdiff_vs_gloo"] = (mine.float() - ref.float()).abs().max().item()
            if op == "all_reduce":  # every rank's bytes, compared in the parent
                row.update({f"{name}_digest": _digest(t) for name, t in got.items()})
            if op == "all_reduce" and rank == 0:  # the sum in fp32, rounded once: how far each lands from it
                exact = sum(comm_bench.weights(n, "cpu", seed=r).float() for r in range(world))
                for name, t in got.items():
                    row[f"{name}_maxdiff_vs_fp32"] = (t.float().cpu() - exact).abs().max().item()
            rows.append(row)
    for c in comms.values():
        c.close()
    return {"rows": rows, **meta}


# --- the parent ---------------------------------------------------------------------------------------------------
def run(world, fn, *args, env=None, backend="gloo", deadline=240.0):
    """run_ranks; every rank's value, or the failure as text (the bench goes on).
    A rendezvous port taken between free_port() (tests/harness/ranks.py) and the store's
    bind (other jobs on the host open ports too) is retried."""
    t0 = time.monotonic()
    for attempt in range(3):
        res = comm_bench.run_ranks(world, fn, *args, env=env, backend=backend, deadline=deadline, pg_timeout=120)
        bad = {r: f"{s}: {v}"[-1500:] for r, (s, v) in res.items() if s != "ok"}
        if not any("EADDRINUSE" in v for v in bad.values()):
            break
        print("  the rendezvous port was taken; again", file=sys.stderr)
    took = time.monotonic() - t0
    if bad:
        print(f"  failed after {took:.0f} s: {bad}", file=sys.stderr)
        return None, "error: " + "; ".join(f"rank {r}: {v.strip().splitlines()[-1] if v.strip() else 'hung'}"
                                           for r, v in bad.items())
    print(f"  done in {took:.0f} s", file=sys.stderr)
    return [res[r][1] for r in range(world)], None


def p2p(a, sizes, fabric_env, save) -> dict:
    """The one-way runs, each a run_ranks call, the comparisons that matter
    most first; save(out) after each, so a run cut short by a time limit
    still leaves what it measured."""
    on_cuda = a.ranks_on == "cuda"
    rails = [int(r) for r in a.rails.split(",")]
    out = {"socket": [], "runs": {}}

    def record(name, fn, *args, **kw):
        print(name, file=sys.stderr)
        vals, err = run(2, fn, *args, **kw)
        if name == "socket":
            out["socket"] = vals[0] if vals else err
        elif vals and "modes" in vals[0]:  # fabric modes side by side: one run each, as fabric_<mode>_r<rails>
            rails_tag = name.split("_")[-1]
            for mode in vals[0]["modes"]:
                out["runs"][f"fabric_{mode}_{rails_tag}"] = _merge_p2p([v["modes"][mode] for v in vals])
        else:
            out["runs"][name] = _merge_p2p(vals) if vals else err
        out["table"] = _p2p_table(out, sizes, sorted(set(rails) | set(a.compressed_rails)))
        save(out)

    record("socket", socket_worker, sizes, rails, a.quick)
    for r in rails:  # raw, with always and auto beside it (interleaved) where those run on r rails
        modes = ["never"] + (["always", "auto"] if r in a.compressed_rails else [])
        record(f"fabric_r{r}", p2p_worker, "fabric:" + ",".join(modes), sizes, on_cuda, a.quick,
               env={**fabric_env, "PZ_FABRIC_RAILS": str(r)})
    record("gloo", p2p_worker, "gloo", sizes, on_cuda, a.quick)
    if on_cuda and torch.cuda.device_count() >= 2:
        record("nccl_socket", p2p_worker, "nccl", sizes, True, a.quick, env=NCCL_SOCKET, backend="nccl")
    else:
        out["runs"]["nccl_socket"] = "skipped: needs 2 GPUs" if on_cuda else "skipped: CPU ranks"
    for r in sorted(set(a.compressed_rails) - set(rails)):
        record(f"fabric_r{r}", p2p_worker, "fabric:always,auto", sizes, on_cuda, a.quick,
               env={**fabric_env, "PZ_FABRIC_RAILS": str(r)})
    return out


def _merge_p2p(vals) -> dict:
    """Rank 0's row (times are already the slowest rank's), rank 1's check."""
    r0, r1 = vals
    rows = [{**x, "ok": y["ok"]} for x, y in zip(r0["rows"], r1["rows"])]
    return {**{k: v for k, v in r0.items() if k != "rows"}, "rows": rows}


def _p2p_table(out, sizes, rails) -> list:
    """Per size: the socket's best stream count, raw fabric per rails, and
    each compressed mode at its best rails; ratios of bests."""
    def gbps(run, size):
        v = out["runs"].get(run)
        return next((x["GBps"] for x in v["rows"] if x["bytes"] == size), None) if isinstance(v, dict) else None

    def best(prefix, size):  # (GB/s, rails) of the fastest rails count that ran
        got = [(gbps(f"{prefix}_r{r}", size), r) for r in rails]
        return max(((v, r) for v, r in got if v), default=(None, None))

    table = []
    socks = out["socket"] if isinstance(out["socket"], list) else []
    for size in sizes:
        row = {"bytes": size}
        top = max((x for x in socks if x["bytes"] == size), key=lambda x: x["GBps"], default=None)
        row["socket"], row["socket_streams"] = (top["GBps"], top["streams"]) if top else (None, None)
        for r in rails:
            row[f"raw_r{r}"] = gbps(f"fabric_never_r{r}", size)
        row["raw_best"], row["raw_rails"] = best("fabric_never", size)
        for how in ("always", "auto"):
            row[how], row[f"{how}_rails"] = best(f"fabric_{how}", size)
        run = out["runs"].get(f"fabric_auto_r{row['auto_rails']}")
        row["auto_plan"] = next((x.get("plan") for x in run["rows"] if x["bytes"] == size), None) \
            if isinstance(run, dict) else None
        row["gloo"] = gbps("gloo", size)
        row["nccl_socket"] = gbps("nccl_socket", size)
        for num, den in (("raw_best", "socket"), ("always", "raw_best"), ("auto", "raw_best"), ("raw_best", "gloo"),
                         ("raw_best", "nccl_socket")):
            row[f"{num.split('_')[0]}_vs_{den.split('_')[0]}"] = row[num] / row[den] if row[num] and row[den] else None
        table.append(row)
    return table


def collectives(a, layout, sizes, ops, fabric_env) -> dict:
    print(f"collectives: {layout['name']}", file=sys.stderr)
    modes = ["always", "auto"]
    vals, err = run(layout["world"], coll_worker, layout, sizes, ops, modes, a.quick, env=fabric_env, deadline=420)
    if vals is None:
        return {"layout": layout, "error": err}
    rows = []
    for i, r0 in enumerate(vals[0]["rows"]):
        per_rank = [v["rows"][i] for v in vals]
        row = {k: v for k, v in r0.items() if not k.endswith("_digest") and not k.endswith("_exact")}
        for name in ["gloo"] + modes:
            if r0["op"] == "all_reduce":
                row[f"{name}_ranks_identical"] = len({x[f"{name}_digest"] for x in per_rank}) == 1
            if name != "gloo":
                row[f"{name}_exact"] = all(x[f"{name}_exact"] for x in per_rank)
                row[f"{name}_vs_gloo"] = row[f"{name}_GBps"] / row["gloo_GBps"]
                if r0["op"] == "all_reduce":
                    row[f"{name}_maxdiff_vs_gloo"] = max(x[f"{name}_maxdiff_vs_gloo"] for x in per_rank)
        rows.append(row)
    return {"layout": layout, "devices": [v["device"] for v in vals], "backend": vals[0]["backend"], "rows": rows}


def layouts(a) -> dict:
    gpus = torch.cuda.device_count() if a.ranks_on == "cuda" else 0
    if gpus >= 2:
        mixed = {"gpu_ranks": [0, 1], "domains": [[0, 1], [2, 3]],
                 "note": "ranks 0,1 on cuda:0,1 (NCCL inside), ranks 2,3 on the CPU (gloo inside)"}
    elif gpus == 1:
        # NCCL refuses two ranks on one GPU, so the two GPU ranks cannot share a
        # native domain: each is its own, and the CPU pair keeps gloo inside.
        mixed = {"gpu_ranks": [0, 1], "domains": [[0], [1], [2, 3]],
                 "note": "one GPU: ranks 0,1 both on cuda:0, each its own domain (NCCL refuses two ranks on one "
                         "GPU); ranks 2,3 on the CPU (gloo inside); unequal domains: no hierarchical all_reduce"}
    else:
        mixed = {"gpu_ranks": [], "domains": [[0, 1], [2, 3]], "note": "CPU ranks only: gloo inside each domain"}
    pair = {"gpu_ranks": [0, 1] if gpus else [], "domains": None,
            "note": f"2 ranks on {'cuda:0 and cuda:1' if gpus >= 2 else 'cuda:0' if gpus else 'the CPU'}, "
                    "each its own domain"}
    return {"mixed": {"name": "mixed", "world": 4, "transport": "auto", **mixed},
            "pair_domains": {"name": "pair_domains", "world": 2, "transport": "fabric", **pair}}


def facts(a, fabric_env) -> dict:
    info = machine_info()
    try:
        import portable_zip._C as c

        info["has_fabric"], info["fabric_probe"] = bool(c.has_fabric), c.fabric_probe()
    except (ImportError, AttributeError) as e:
        info["has_fabric"], info["fabric_probe"] = False, str(e)
    info["gpus_visible"] = torch.cuda.device_count()
    info["ranks_on"] = a.ranks_on
    info["fabric_env"] = fabric_env
    info["cpu_count"] = os.cpu_count()
    info["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
    return info


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--ranks-on", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default=None, help=f"p2p sizes (default {SIZES}; --quick {QUICK_SIZES})")
    p.add_argument("--coll-sizes", default=None, help=f"collective sizes (default {COLL_SIZES}; --quick {QUICK_COLL_SIZES})")
    p.add_argument("--rails", default="1,2,4", help="PZ_FABRIC_RAILS values; also the socket stream counts")
    p.add_argument("--compressed-rails", default=None,
                   help="rails values for compress=always/auto (default: --rails; --quick: 2 alone)")
    p.add_argument("--provider", default="tcp;ofi_rxm", help="PZ_FABRIC_PROVIDER")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer reps")
    p.add_argument("--p2p", action="store_true", help="the one-way table (the default section)")
    p.add_argument("--mixed", action="store_true", help="4 ranks in domains [[0,1],[2,3]]: collectives vs gloo")
    p.add_argument("--pair-domains", action="store_true", help="2 ranks, each its own domain: all_reduce vs gloo")
    a = p.parse_args()
    if a.ranks_on == "cuda" and not torch.cuda.is_available():
        p.error("--ranks-on cuda, but no GPU is visible")
    if a.compressed_rails is None:
        a.compressed_rails = "2" if a.quick and "2" in a.rails.split(",") else a.rails
    a.compressed_rails = [int(r) for r in a.compressed_rails.split(",")]
    if not (a.p2p or a.mixed or a.pair_domains):
        a.p2p = True
    sizes = [parse_size(s) for s in (a.sizes or (QUICK_SIZES if a.quick else SIZES)).split(",")]
    coll_sizes = [parse_size(s) for s in (a.coll_sizes or (QUICK_COLL_SIZES if a.quick else COLL_SIZES)).split(",")]
    fabric_env = {"PZ_FABRIC_PROVIDER": a.provider}
    t0 = time.monotonic()
    doc = {"machine": facts(a, fabric_env)}
    print(f"fabric probe: has_fabric={doc['machine']['has_fabric']} {doc['machine']['fabric_probe']!r}", file=sys.stderr)

    def save():
        doc["seconds"] = round(time.monotonic() - t0, 1)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    if a.p2p:
        doc["p2p"] = p2p(a, sizes, fabric_env, lambda part: (doc.update(p2p=part), save()))
        run0 = next((v for k, v in doc["p2p"]["runs"].items() if k.startswith("fabric") and isinstance(v, dict)), None)
        if run0:
            doc["machine"]["libfabric"] = run0["info"].get("version")
            doc["machine"]["fabric_info"] = run0["info"]
        save()
    lay = layouts(a)
    if a.mixed:
        doc["mixed"] = collectives(a, lay["mixed"], coll_sizes, COLL_OPS, fabric_env)
        save()
    if a.pair_domains:
        doc["pair_domains"] = collectives(a, lay["pair_domains"], coll_sizes, ("all_reduce",), fabric_env)
        save()
    save()
    show(doc)
    print(f"wrote {a.out} ({doc['seconds']:.0f} s)")


def show(doc) -> None:
    m = doc["machine"]
    where = f"{m.get('gpu', 'CPU')} ranks" if m["ranks_on"] == "cuda" else f"CPU ranks ({m['cpu_count']} cores)"
    if "p2p" in doc:
        short = {"socket_streams": "n", "raw_rails": "rails", "auto_plan": "plan", "nccl_socket": "nccl",
                 "raw_vs_socket": "raw/sock", "always_vs_raw": "alw/raw", "raw_vs_gloo": "raw/gloo"}
        t = doc["p2p"]["table"]
        rows = [{short.get(k, k): v for k, v in {**r, "size": fmt_size(r["bytes"])}.items()} for r in t]
        cols = ["size", "socket", "n"] + [c for c in t[0] if c.startswith("raw_r") and c[5:].isdigit()] + \
            ["rails", "always", "auto", "plan", "gloo", "nccl", "raw/sock", "alw/raw", "raw/gloo"]
        print_table(rows, cols, f"one-way GB/s, 2 processes, {where}, libfabric {m.get('libfabric')} "
                                f"{m['fabric_env']['PZ_FABRIC_PROVIDER']}; n: socket streams; always/auto: their best rails")
        for k, v in doc["p2p"]["runs"].items():
            if isinstance(v, str):
                print(f"{k}: {v}")
            elif any(x.get("ok") is False for x in v["rows"]):
                print(f"{k}: RECEIVED BYTES DIFFER at {[x['bytes'] for x in v['rows'] if x.get('ok') is False]}")
    for sec in ("mixed", "pair_domains"):
        if sec not in doc:
            continue
        d = doc[sec]
        if "error" in d:
            print(f"{sec}: {d['error']}")
            continue
        rows = [{**r, "size": fmt_size(r["bytes"])} for r in d["rows"]]
        cols = ["op", "size", "gloo_GBps", "always_GBps", "auto_GBps", "auto_plan", "always_vs_gloo", "auto_vs_gloo",
                "always_exact", "auto_exact"]
        print_table(rows, cols, f"{sec}: {d['layout']['note']}; domains {d['layout']['domains']}; GB/s of each "
                                "rank's input bytes (exact: bit-equal to gloo on every rank)")
        for r in d["rows"]:
            if r["op"] == "all_reduce":
                print(f"  all_reduce {fmt_size(r['bytes'])}: max |ours - gloo| always {r['always_maxdiff_vs_gloo']:.3g}"
                      f", auto {r['auto_maxdiff_vs_gloo']:.3g}; vs the fp32 sum: gloo {r['gloo_maxdiff_vs_fp32']:.3g},"
                      f" always {r['always_maxdiff_vs_fp32']:.3g}; ranks bit-identical: gloo "
                      f"{r['gloo_ranks_identical']}, always {r['always_ranks_identical']}, "
                      f"auto {r['auto_ranks_identical']}")


if __name__ == "__main__":
    main()
