"""Training steps over the "pz" torch.distributed backend against the plain
backend, side by side in one run: FSDP2 (bf16 params with fp32 reduce, and
pure bf16) and DDP (fp32 grads) of a seeded causal transformer, one group per
mode, the modes' steps interleaved so load from other jobs hits them alike.

    python -P bench/dropin.py --link netns [--gbit 1 5]   2 ranks in 2 network namespaces over a shaped
                                                           link (root, iproute2; its limit measured in the run)
    python -P bench/dropin.py --link local                2 CPU ranks over loopback
    python -P bench/dropin.py --device cuda               2 ranks on one GPU (cuda:0): pz groups over the
                                                           fabric, gloo (CUDA tensors) beside them
    python -P bench/dropin.py --device cuda --link netns --gbit 10 25
                                                           the same 2 GPU ranks, each in its own namespace:
                                                           every byte between them crosses the shaped link
    [--steps 10] [--warmup 3] [--out FILE.json] [--wrappings fsdp2 fsdp2_bf16 ddp] [--dim 512 --layers 6 ...]

Modes: gloo (the plain backend), pz never (the backend's own cost, same
bytes), pz auto, pz always. Step time: median over steps of the slower rank's
wall time (zero_grad, forward, backward, optimizer step; CUDA synchronized).
Wire bytes per step from ProcessGroupPZ.stats. Speed-up = gloo / pz (on the
GPU also never / pz: the fabric's raw speed). Weights are a fresh seeded
init (N(0, 0.02) linears, as GPT-2 starts): trained weights' bf16 exponents
are narrower and compress better, so ratios here are conservative."""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, netns_link, under python -P too
from pzbench.common import machine_info  # noqa: E402

from portable_zip import netns  # noqa: E402

MODES = ("gloo", "never", "auto", "always")
WRAPPINGS = ("fsdp2", "fsdp2_bf16", "ddp")
TARGETS = {"fsdp2": 1.25, "fsdp2_bf16": 1.25, "ddp": 1.10}  # the issue's, where the link bounds the step
WORST = 0.97  # never slower than the plain backend by more than 3%


class Block(nn.Module):
    """Pre-norm causal self-attention and a 4x MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def _wrap(kind: str, model: LM, group, device: torch.device):
    """model wrapped for data parallelism over group (FSDP2: each block, then the root)."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, process_group=group, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = DeviceMesh.from_group(group, device.type)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if kind == "fsdp2" else \
        MixedPrecisionPolicy()
    if kind == "fsdp2_bf16":
        model.to(torch.bfloat16)  # params, grads, reduce-scatter and AdamW state all bf16
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


class Trainer:
    """One mode's model, optimizer and group."""

    def __init__(self, kind: str, mode: str, group, a, device: torch.device):
        self.mode, self.group, self.device = mode, group, device
        torch.manual_seed(0)  # every rank and mode: the same weights
        model = LM(a.vocab, a.dim, a.layers, a.heads, a.seq).to(device)
        self.model = _wrap(kind, model, group, device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1000 + dist.get_rank())  # per-rank data
        self.x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(device)
        self.y = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(device)
        self.times = []

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(self.x).float().flatten(0, 1), self.y.flatten())
        loss.backward()
        self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _stats(group) -> dict:
    """Per op {calls, raw_bytes, wire_bytes, plans} of a pz group (every device kind summed)."""
    out = {}
    for ops in getattr(group, "stats", {}).values():
        for op, s in ops.items():
            o = out.setdefault(op, {"calls": 0, "raw_bytes": 0, "wire_bytes": 0, "time_s": 0.0, "plans": {}})
            for k in ("calls", "raw_bytes", "wire_bytes", "time_s"):
                o[k] += s[k]
            for p, n in s["plans"].items():
                o["plans"][p] = o["plans"].get(p, 0) + n
    return out


def _per_step(before: dict, after: dict, steps: int) -> dict:
    out = {}
    for op, s in after.items():
        b = before.get(op, {"calls": 0, "raw_bytes": 0, "wire_bytes": 0, "time_s": 0.0, "plans": {}})
        d = {k: (s[k] - b[k]) / steps for k in ("calls", "raw_bytes", "wire_bytes", "time_s")}
        if d["calls"]:
            d["plans"] = {p: (n - b["plans"].get(p, 0)) / steps for p, n in s["plans"].items()
                          if n - b["plans"].get(p, 0)}
            out[op] = d
    return out


def _model(group, device) -> dict:
    """What auto's cost model holds after the steps: its calibration, the
    slowdown it learned, and its (native, compressed) predictions in ms at
    the sizes these steps move, to set beside what the modes ran."""
    c = group.communicator(device.type) if hasattr(group, "communicator") else None
    if c is None or c.policy.cal is None:
        return {}
    p = c.policy
    pred = {f"{op} {str(dt).split('.')[-1]} {mib} MiB": [round(x * 1e3, 3) for x in p.predict(op, dt, mib << 20, c.world)]
            for op in ("all_gather", "reduce_scatter", "all_reduce") for dt in (torch.bfloat16, torch.float32)
            for mib in (1, 4, 16, 25)}
    return {"calibration": p.cal.describe(), "slowdown": p.slowdown, "raw_slowdown": p.raw_slowdown, "margin": p.margin, "predicted_ms": pred}


def _groups(modes, transport: str) -> dict:
    import portable_zip  # noqa: F401  (registers "pz")
    from portable_zip.c10d import Options
    return {m: dist.new_group(backend="gloo") if m == "gloo" else
            dist.new_group(backend="pz", pg_options=Options(compress=m, transport=transport)) for m in modes}


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def worker(a) -> None:
    """One rank: every wrapping, its modes' steps interleaved."""
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=a.op_timeout))
    rank = dist.get_rank()
    torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    if a.device == "cuda":
        torch.cuda.set_device(0)  # both ranks on one GPU
        device = torch.device("cuda", 0)
    groups = _groups(a.modes, a.transport)
    res = {}
    for kind in a.wrappings:
        trainers, errors = {}, {}
        for mode in a.modes:
            try:  # a mode the backend cannot serve (gloo's CUDA reduce_scatter, say) fails alike on every rank
                t = Trainer(kind, mode, groups[mode], a, device)
                t.step()
                trainers[mode] = t
            except Exception as e:  # noqa: BLE001 (recorded in the results, the other modes go on)
                errors[mode] = _short(e)
                print(f"{kind} {mode}: {errors[mode]}", flush=True)
        for _ in range(a.warmup - 1):
            for t in trainers.values():
                t.step()
        before = {m: _stats(groups[m]) for m in trainers}
        for _ in range(a.steps):
            for t in trainers.values():
                dist.barrier()
                t0 = time.perf_counter()
                t.step()
                t.times.append(time.perf_counter() - t0)
        rows = {}
        for m, t in trainers.items():
            times = torch.tensor(t.times, dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slower rank's time, step by step
            rows[m] = {"step_ms": statistics.median(times.tolist()) * 1e3,
                       "steps_ms": [round(x * 1e3, 2) for x in times.tolist()],
                       "per_step": _per_step(before[m], _stats(groups[m]), a.steps)}
            if m == "auto":
                rows[m]["model"] = _model(groups[m], device)
        rows.update({m: {"error": e} for m, e in errors.items()})
        res[kind] = rows
        if rank == 0:
            print(f"{kind}: " + ", ".join(f"{m} {r['step_ms']:.0f} ms" for m, r in rows.items() if "step_ms" in r),
                  flush=True)
        del trainers
    params = sum(p.numel() for p in LM(a.vocab, a.dim, a.layers, a.heads, a.seq).parameters())
    dist.barrier()
    netns.report({"rank": rank, "wrappings": res, "params": params, "torch_threads": torch.get_num_threads()})
    dist.destroy_process_group()


def _local(argv: list, timeout: float) -> list:
    """argv once per rank on this machine over loopback, the per-rank results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = netns.Ranks(echo=True)
    try:  # a signal (netns.exit_on_signals) or an error still ends every rank
        for r in range(2):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            ranks.add(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, start_new_session=True))
        ranks.wait(timeout, 15.0)
    finally:
        netns.Link._kill(ranks.procs)
    if any(ranks.codes):
        raise RuntimeError(f"ranks failed (exit codes {ranks.codes}):\n" + "\n".join(ranks.lines[-40:]))
    return ranks.results()


def _merged(results: list) -> dict:
    """Rank 0's results of several runs (one wrapping each) as one."""
    out = dict(results[0], wrappings={})
    for r in results:
        out["wrappings"].update(r["wrappings"])
    return out


def summarize(res: dict, device: str, limit_bound: bool, gbit: float = 0.0) -> dict:
    """Rank 0's rows with speed-ups (gloo / pz; on a GPU also never / pz) and
    the issue's targets checked (the speed-up targets only where limit_bound).
    gbit: the link's measured rate, for each pz mode's link floor: the time its
    wire bytes take at that rate (what a rank sends, one direction of the link),
    and its share of the step (near 1: the link binds)."""
    out = {}
    for kind, rows in res["wrappings"].items():
        ok = {m: r for m, r in rows.items() if "step_ms" in r}
        for m, r in ok.items():
            if m == "gloo":
                continue
            for base in ("gloo", "never") if device == "cuda" else ("gloo",):
                if base in ok and base != m:
                    r[f"speedup_vs_{base}"] = round(ok[base]["step_ms"] / r["step_ms"], 3)
            wire = sum(o["wire_bytes"] for o in r["per_step"].values())
            raw = sum(o["raw_bytes"] for o in r["per_step"].values())
            r["wire_mb_per_step"], r["raw_mb_per_step"] = round(wire / 1e6, 2), round(raw / 1e6, 2)
            r["wire_ratio"] = round(wire / raw, 4) if raw else None
            if gbit > 0:
                floor_ms = wire * 8 / (gbit * 1e9) * 1e3
                r["link_floor_ms"], r["link_share"] = round(floor_ms, 1), round(floor_ms / r["step_ms"], 3)
        base = "gloo" if "gloo" in ok else "never"
        best = max((r.get(f"speedup_vs_{base}", 0) for m, r in ok.items() if m in ("auto", "always")), default=None)
        worst = min((r.get(f"speedup_vs_{base}", 9) for m, r in ok.items() if m not in ("gloo", base)), default=None)
        check = {"baseline": base, "auto_speedup": ok.get("auto", {}).get(f"speedup_vs_{base}"),
                 "best_speedup": best, "worst_speedup": worst,
                 "never_slower_than_3pct": worst is not None and worst >= WORST}
        if limit_bound:
            check["target"] = TARGETS[kind]
            check["auto_meets_target"] = bool(check["auto_speedup"] and check["auto_speedup"] >= TARGETS[kind])
        out[kind] = {"modes": rows, "check": check}
    return out


def _print(summary: dict, title: str) -> None:
    print(title, flush=True)
    for kind, s in summary.items():
        cells = []
        for m, r in s["modes"].items():
            if "error" in r:
                cells.append(f"{m}: {r['error'][:60]}")
                continue
            sp = "".join(f" {v:.2f}x" for k, v in r.items() if k.startswith("speedup_vs_"))
            wire = f" {r['wire_mb_per_step']:.1f} MB" if "wire_mb_per_step" in r else ""
            wire += f" (link {r['link_share']:.0%})" if "link_share" in r else ""
            cells.append(f"{m} {r['step_ms']:.0f} ms{sp}{wire}")
        print(f"  {kind:11s} " + " | ".join(cells), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", choices=("netns", "local"), default=None,
                   help="netns: a shaped link between 2 namespaces (default on CPU); local: loopback")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--gbit", type=float, nargs="+", default=[1.0, 5.0], help="netns link rates, one run each")
    p.add_argument("--transport", default=None, help="pz groups' transport (default: fabric on cuda, else auto)")
    p.add_argument("--wrappings", nargs="+", choices=WRAPPINGS, default=list(WRAPPINGS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (>= 1)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=8, help="tokens per sequence (few: the link, not a 2-core CPU's "
                   "matmuls, bounds the step; at 64 this VM's FSDP2 step was 3.9 s, compute-bound at 1 Gbit/s)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step (small: the link bounds the step)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per rank")
    p.add_argument("--op-timeout", type=float, default=300.0, help="seconds a collective may take")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds a whole run of ranks may take")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.steps < 1 or a.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    if a.dim % a.heads:
        p.error(f"--dim {a.dim} must be a multiple of --heads {a.heads}")
    a.link = a.link or ("local" if a.device == "cuda" else "netns")
    a.transport = a.transport or ("fabric" if a.device == "cuda" else "auto")
    if a.worker:
        worker(a)
        return
    if a.device == "cuda" and a.transport != "fabric":
        p.error("--device cuda runs its 2 ranks on one GPU: pz's groups go over the fabric (NCCL refuses two "
                "ranks on one GPU, gloo moves no CUDA tensors of pz's)")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/dropin.py: --device cuda but torch sees no GPU")
    # One pair of rank processes per wrapping: what a wrapping's ranks allocate (and
    # whatever the backend holds on to) ends with them, not in the next wrapping's steps.
    me = [sys.executable, "-P", os.path.abspath(__file__), "--worker"] + [x for x in sys.argv[1:] if x != "--worker"]
    me += ["--link", a.link, "--transport", a.transport]
    argvs = [me + ["--wrappings", kind] for kind in a.wrappings]
    load, runs = os.getloadavg(), []
    netns.exit_on_signals()
    if a.link == "netns":
        why = netns.unavailable()
        if why:
            sys.exit(f"bench/dropin.py: no shaped link here: {why}")
        from netns_link import on_link
        for gbit in a.gbit:
            desc, limit, res = on_link(gbit, argvs[0], timeout=a.timeout, more=argvs[1:])
            res = _merged([r[0] for r in (res if len(argvs) > 1 else [res])])
            s = summarize(res, a.device, limit_bound=True, gbit=limit["gbit"])
            _print(s, f"{desc}; plain TCP {limit['gbit']:.2f} Gbit/s (after: {limit['gbit_after']:.2f})")
            runs.append({"link": desc, "configured_gbit": gbit, "limit": limit, "params": res["params"],
                         "torch_threads": res["torch_threads"], "wrappings": s})
    else:
        res = _merged([_local(argv, a.timeout)[0] for argv in argvs])
        s = summarize(res, a.device, limit_bound=False)
        _print(s, f"2 ranks, {a.device}, loopback" + (" (one GPU)" if a.device == "cuda" else ""))
        runs.append({"link": "loopback" + (", one GPU, pz transport " + a.transport if a.device == "cuda" else ""),
                     "params": res["params"], "torch_threads": res["torch_threads"], "wrappings": s})
    if a.out:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
        doc = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "machine": machine_info(),
               "command": " ".join([sys.executable, "-P"] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
               "host": {"cores": os.cpu_count(), "cpu_model": model,
                        "load_avg_1_5_15_min": {"before": load, "after": os.getloadavg()}},
               "config": {k: getattr(a, k) for k in ("device", "link", "transport", "wrappings", "modes", "steps",
                                                      "warmup", "vocab", "dim", "layers", "heads", "seq", "batch",
                                                      "threads")},
               "weights": "seeded init: linears and embeddings N(0, 0.02) (fresh, not trained)",
               "targets": {"speedup_where_link_bound": TARGETS, "never_below": WORST}, "runs": runs}
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
