"""A real training loop for comparing data-parallel wrappings bit for bit: a
small causal transformer built in code (seeded, no downloads), a synthetic
token stream per rank, AdamW, and per-step fingerprints of the full
parameters (sharded ones gathered), run on every rank.

    results = run_training(world, [Run("ddp"), Run("ddp_hook", compress="always")])

Wrappings are looked up by name in WRAPPINGS (add one with @wrapping). A
run trains over the world run_training's backend= made (run_ranks'), or,
with Run.backend, over a fresh world of its own (e.g. the "pz" backend with
pz Options(compress=run.compress)): the same runs serve torch's gloo/NCCL
and other torch.distributed backends."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .ranks import run_ranks

VOCAB, D_MODEL, HEADS, LAYERS, FF, SEQ, BATCH = 128, 64, 4, 2, 256, 16, 4
# Where the fresh worlds' store is reached (rank 0 serves it on every interface):
# loopback for local ranks; a multi-host run (tests/cluster_worker.py) sets MASTER_ADDR.
STORE_HOST = "127.0.0.1"
BUCKET_MB = 0.1  # DDP buckets of ~100 KB: several per step, so hooks overlap and complete out of step


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        self.fc1, self.fc2 = nn.Linear(D_MODEL, FF), nn.Linear(FF, D_MODEL)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build_model(seed: int, device: str) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().to(device)


def batch(seed: int, rank: int, step: int, device: str, size: int = BATCH):
    """Rank's tokens of a step: affine sequences x' = (a x + c) mod VOCAB with
    10% noise, so the loss falls; (inputs, targets)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    a = torch.randint(1, 8, (size, 1), generator=g) * 2 + 1
    c = torch.randint(0, VOCAB, (size, 1), generator=g)
    x = torch.empty(size, SEQ + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (size,), generator=g)
    for t in range(SEQ):
        x[:, t + 1] = (a[:, 0] * x[:, t] + c[:, 0]) % VOCAB
    noise = torch.rand(x.shape, generator=g) < 0.1
    x = torch.where(noise, torch.randint(0, VOCAB, x.shape, generator=g), x)
    return x[:, :-1].to(device), x[:, 1:].to(device)


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run. wrapping: a WRAPPINGS name; compress: the hooks'
    mode, and the pz backend's; backend: train over a fresh world of this
    backend ("pz", "cpu:pz", "gloo"; None: the world run_ranks made), or with
    subgroup, over new_group(backend=...) of that world (DDP only);
    transport: the pz backend's Options.transport; param_dtype/reduce_dtype: FSDP2's MixedPrecisionPolicy;
    divide_factor: FSDP2's set_gradient_divide_factor; force_sum: its
    set_force_sum_reduction_for_comms (SUM on the wire, divided after); values: return the
    parameters after each step too (from rank 0 only: replicas are compared
    by fingerprint)."""
    wrapping: str
    compress: str = "auto"
    steps: int = 20
    seed: int = 0
    device: str = "cpu"
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    divide_factor: Optional[float] = None
    force_sum: bool = False
    values: bool = True
    backend: Optional[str] = None
    subgroup: bool = False
    transport: str = "auto"

    def pg_options(self):
        """The pg_options of this run's groups: pz's Options where the backend is pz, else None."""
        if self.backend is None or "pz" not in self.backend:
            return None
        from portable_zip.c10d import Options
        return Options(compress=self.compress, transport=self.transport)


@dataclasses.dataclass
class Wrapped:
    module: nn.Module
    stats: Callable[[], dict]  # the hooks' Communicator stats ({} without hooks)
    close: Callable[[], None] = lambda: None
    groups: Callable[[], dict] = lambda: {"world": dist.group.WORLD}  # the groups it communicates over, by name


WRAPPINGS: Dict[str, Callable[[nn.Module, Run], Wrapped]] = {}


def wrapping(name: str):
    def register(fn):
        WRAPPINGS[name] = fn
        return fn
    return register


def _dp_group(run):
    """DDP's process_group: a new group of run.backend over the world (subgroup runs), else the world."""
    if not run.subgroup:
        return None
    if run.backend is None:
        raise ValueError("a subgroup run names its backend")
    return dist.new_group(backend=run.backend, pg_options=run.pg_options())


@wrapping("ddp")
def _ddp(model, run):
    from torch.nn.parallel import DistributedDataParallel as DDP
    g = _dp_group(run)
    return Wrapped(DDP(model, bucket_cap_mb=BUCKET_MB, process_group=g), dict,
                   groups=lambda: {"dp": g if g is not None else dist.group.WORLD})


@wrapping("ddp_hook")
def _ddp_hook(model, run):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from portable_zip.ddp import DDPHookState, ddp_comm_hook
    g = _dp_group(run)
    m, state = DDP(model, bucket_cap_mb=BUCKET_MB, process_group=g), DDPHookState(g, compress=run.compress)
    m.register_comm_hook(state, ddp_comm_hook)
    return Wrapped(m, lambda: state.stats, state.close, lambda: {"dp": g if g is not None else dist.group.WORLD})


def _sharded(model, run, mesh, hooks: bool) -> Wrapped:
    """fully_shard on each block, then the root; with hooks, pz's on every unit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from portable_zip import fsdp
    mp = MixedPrecisionPolicy(param_dtype=run.param_dtype, reduce_dtype=run.reduce_dtype)
    units = [fully_shard(b, mesh=mesh, mp_policy=mp) for b in model.blocks]
    units.append(fully_shard(model, mesh=mesh, mp_policy=mp))
    ag, rs = (fsdp.AllGather(compress=run.compress), fsdp.ReduceScatter(compress=run.compress)) if hooks else (None, None)
    for u in units:
        if run.force_sum:  # only when asked: older torch (2.11) may lack the setter
            u.set_force_sum_reduction_for_comms(True)
        if run.divide_factor is not None:
            u.set_gradient_divide_factor(run.divide_factor)
        if hooks:
            u.set_custom_all_gather(ag)
            u.set_custom_reduce_scatter(rs)
    groups = {name: mesh.get_group(name) for name in mesh.mesh_dim_names}
    if not hooks:
        return Wrapped(model, dict, groups=lambda: groups)
    return Wrapped(model, lambda: fsdp.merged_stats([ag.stats, rs.stats]),
                   lambda: (ag.close(), rs.close()), lambda: groups)


def _mesh(run, shape, names):
    """The run's DeviceMesh; a fresh world's backend and pz options on every
    dim through backend_override, torch's documented way (torch passes a
    mesh's groups none of the world's pg_options)."""
    from torch.distributed.device_mesh import init_device_mesh
    override, opts = None, run.pg_options()
    if len(shape) > 1 and opts is not None and opts != type(opts)():  # default options need no override
        override = {name: (run.backend, run.pg_options()) for name in names}
    return init_device_mesh(torch.device(run.device).type, shape, mesh_dim_names=names, backend_override=override)


for _name, _hooks in (("fsdp", False), ("fsdp_hook", True)):
    wrapping(_name)(lambda model, run, h=_hooks: _sharded(model, run, _mesh(run, (dist.get_world_size(),), ("shard",)),
                                                          h))
for _name, _hooks in (("hsdp", False), ("hsdp_hook", True)):
    # 2 shards per replica: the replicate all-reduce is FSDP2's own dist.all_reduce (no hook replaces it).
    wrapping(_name)(lambda model, run, h=_hooks: _sharded(
        model, run, _mesh(run, (dist.get_world_size() // 2, 2), ("dp", "shard")), h))


def full_parameters(model: nn.Module) -> List[torch.Tensor]:
    """Every parameter whole, in registration order. DTensor shards travel in
    one all_gather_object for all of them (a collective; one full_tensor per
    parameter would be ~40 collectives a step)."""
    params = [p.detach() for p in model.parameters()]
    if not any(hasattr(p, "to_local") for p in params):
        return [p.cpu().contiguous() for p in params]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [p.to_local().cpu().contiguous() for p in params])
    return [_whole(p, [e[i] for e in every]) for i, p in enumerate(params)]


def _whole(p, shards: List[torch.Tensor]) -> torch.Tensor:
    """p's full value from every global rank's local shard: replicated mesh
    dims read at coordinate 0, the one sharded dim concatenated in mesh order."""
    mesh, places = p.device_mesh.mesh, p.placements
    sharded = [pl for pl in places if pl.is_shard()]
    if len(sharded) > 1:
        raise ValueError(f"parameter with placements {places}: one sharded mesh dim supported")
    ranks = mesh[tuple(slice(None) if pl.is_shard() else 0 for pl in places)].reshape(-1).tolist()
    if not sharded:
        return shards[ranks[0]]
    return torch.cat([shards[r] for r in ranks], dim=sharded[0].dim)


def fingerprint(params: List[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in params:
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def group_stats(groups: dict) -> dict:
    """{name: the group's .stats} for the groups that keep stats (the pz backend's)."""
    return {name: g.stats for name, g in groups.items() if hasattr(g, "stats")}


def train_one(rank: int, run: Run) -> dict:
    """run on this rank: {"fingerprints", "losses", "values" (rank 0: fp32 numpy, per step), "stats",
    "group_stats" (the pz groups' stats: group_stats)}."""
    model = build_model(run.seed, run.device)
    w = WRAPPINGS[run.wrapping](model, run)
    opt = torch.optim.AdamW(w.module.parameters(), lr=3e-3, weight_decay=0.01)
    out = {"fingerprints": [], "losses": [], "values": []}
    try:
        for step in range(run.steps):
            x, y = batch(run.seed, rank, step, run.device)
            loss = F.cross_entropy(w.module(x).float().reshape(-1, VOCAB), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            params = full_parameters(model)
            out["fingerprints"].append(fingerprint(params))
            out["losses"].append(loss.item())
            if run.values and rank == 0:
                # numpy: a tensor would cross the queue as shared memory, gone when the rank exits
                out["values"].append(torch.cat([p.float().reshape(-1) for p in params]).numpy())
        out["stats"] = w.stats()
        out["group_stats"] = group_stats(w.groups())
    finally:
        w.close()
    return out


def deterministic() -> None:
    """Kernels that give the same bits every run, so runs differ only by
    their communication: one CPU thread per rank (ranks share the cores),
    and on GPUs torch's deterministic algorithms and the math attention (the
    fused attention backwards accumulate with atomics)."""
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)


class Worlds:
    """Fresh default worlds on demand: each from its own prefix of one
    TCPStore that rank 0 serves on a port the OS picked (told to the others
    over the world run_ranks made), so no port is guessed."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.made = rank, world, 0
        self.first = dist.get_backend()
        port = [None]
        if rank == 0:
            self.store = dist.TCPStore(STORE_HOST, 0, world, is_master=True, wait_for_workers=False)
            port = [self.store.port]
        dist.broadcast_object_list(port, src=0)
        if rank != 0:
            self.store = dist.TCPStore(STORE_HOST, port[0], world, is_master=False)

    def enter(self, backend: Optional[str] = None, pg_options=None) -> None:
        """Replace the default world with a fresh one of backend (None: the first world's)."""
        if backend is not None and "pz" in backend:
            import portable_zip  # noqa: F401  (registers the "pz" backend)
        dist.destroy_process_group()
        self.made += 1
        dist.init_process_group(backend or self.first, store=dist.PrefixStore(f"world{self.made}", self.store),
                                rank=self.rank, world_size=self.world, pg_options=pg_options)


def on_world(rank: int, world: int, runs: list, body: Callable) -> list:
    """body(run) for each run: over run_ranks' world, or for a run whose
    backend is set (and not a subgroup run), over a fresh world of that
    backend, with the first world's backend back after it."""
    worlds = Worlds(rank, world) if any(r.backend is not None and not r.subgroup for r in runs) else None
    out = []
    for run in runs:
        own = run.backend is not None and not run.subgroup
        if own:
            worlds.enter(run.backend, run.pg_options())
        out.append(body(run))
        if own:
            worlds.enter()
    return out


def train(rank: int, world: int, runs: List[Run]) -> List[dict]:
    """Every run in turn on this rank (on_world: the world each asks for)."""
    deterministic()
    return on_world(rank, world, runs, lambda r: train_one(rank, r))


def run_training(world: int, runs: List[Run], backend: Optional[str] = "gloo", env: Optional[dict] = None,
                 deadline: float = 300.0) -> Dict[int, List[dict]]:
    """runs on `world` local ranks: {rank: [result per run]}; a rank's error raises here."""
    res = run_ranks(world, train, list(runs), env=env, backend=backend, deadline=deadline)
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    if bad:
        raise RuntimeError("\n".join(f"rank {r}: {s}: {v}" for r, (s, v) in sorted(bad.items())))
    return {r: v[1] for r, v in res.items()}
