"""Rank functions of tests/test_hooks.py that call the hooks directly:
PREMUL_SUM against its definition, mixed-dtype (uint8) all-gathers through
FSDP2's own unshard, async handles, and bad input inside a process group."""
import torch
import torch.distributed as dist
import torch.nn as nn

from portable_zip import fsdp
from portable_zip.ddp import DDPHookState, ddp_comm_hook


def _inputs(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    return (torch.randn(numel, generator=g) * 0.05).to(dtype)


def premul_reduce_scatter(rank: int, world: int, seed: int, device: str = "cpu",
                          dtypes=(torch.bfloat16, torch.float32)) -> list:
    """ReduceScatter under PREMUL_SUM(f), AVG and SUM, against its definition:
    each rank's input times f (f rounded to the dtype, one rounding of the
    product), summed in rank order in fp32, rounded once. Returns
    (dtype, op, mode, same bits) rows."""
    rows = []
    n = 4099  # odd: shards of world * n elements
    for dtype in dtypes:
        mine = _inputs(rank, world * n, dtype, seed).to(device)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        for name, op, factor in (("PREMUL_SUM(1/3)", dist._make_nccl_premul_sum(1 / 3), 1 / 3),
                                 ("AVG", dist.ReduceOp.AVG, None), ("SUM", dist.ReduceOp.SUM, None)):
            scaled = [fsdp.premultiplied(t, factor) if factor is not None else t for t in every]
            acc = scaled[0].float()
            for t in scaled[1:]:
                acc = acc + t.float()
            want = (acc / world if name == "AVG" else acc).to(dtype)[rank * n:(rank + 1) * n]
            for mode in ("never", "always"):
                hook = fsdp.ReduceScatter(compress=mode)
                out = hook.allocate((n,), dtype=dtype, device=torch.device(device))
                before = mine.clone()
                assert hook(out, mine, dist.group.WORLD, op) is None  # blocking, as FSDP2 calls it
                rows.append((str(dtype), name, mode, torch.equal(out.view(torch.uint8), want.view(torch.uint8)),
                             torch.equal(mine, before)))  # the caller's input is left as it was
                hook.close()
    return rows


class Mixed(nn.Module):
    """Parameters of two dtypes in one FSDP2 unit (a frozen bf16 base and a
    trainable fp32 adapter, as FSDP2 requires one trainable dtype): its
    all-gather is one uint8 buffer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 48)
        self.b = nn.Linear(48, 32).to(torch.bfloat16).requires_grad_(False)


def mixed_unshard(rank: int, world: int, seed: int, device: str = "cpu") -> dict:
    """FSDP2's own unshard (blocking and async_op=True) of a unit with fp32
    and bf16 parameters through pz.fsdp.AllGather(compress="always"): every
    parameter whole and bit-exact, the uint8 buffer moved raw (wire bytes
    not below raw bytes)."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    ref = Mixed().to(device)
    want = [p.detach().clone() for p in ref.parameters()]
    m = Mixed().to(device)
    m.load_state_dict(ref.state_dict())
    fully_shard(m)
    hook = fsdp.AllGather(compress="always")
    m.set_custom_all_gather(hook)
    out = {}
    for mode in ("blocking", "async"):
        handle = m.unshard(async_op=mode == "async")
        if mode == "async":
            assert handle is not None
            handle.wait()
        got = [p.detach() for p in m.parameters()]  # unsharded: plain tensors
        out[mode] = all(torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
                        for g, w in zip(got, want)) and len(got) == len(want)
        m.reshard()
    s = hook.stats["all_gather"]
    out["stats"] = (s["raw_bytes"], s["wire_bytes"], s["plans"])
    hook.close()
    return out


def async_all_gather(rank: int, world: int, seed: int, device: str = "cpu") -> bool:
    """An async AllGather returns a torch.distributed Work (FSDP2 waits only
    on one); after wait() the output holds every rank's input (on a GPU, for
    work queued on the waiting stream)."""
    hook = fsdp.AllGather(compress="always")
    inp = _inputs(rank, 1000, torch.bfloat16, seed).to(device)
    out = torch.empty(world * 1000, dtype=torch.bfloat16, device=device)
    w = hook(out, inp, dist.group.WORLD, async_op=True)
    ok = isinstance(w, dist.Work) and w.wait()
    want = torch.empty_like(out)
    dist.all_gather_into_tensor(want, inp)
    hook.close()
    return bool(ok) and torch.equal(out.view(torch.uint8), want.view(torch.uint8))


class _Bucket:
    """Enough of dist.GradBucket for the hook: its flat buffer."""

    def __init__(self, t):
        self._t = t

    def buffer(self):
        return self._t


def ddp_bad_input(rank: int, world: int) -> dict:
    """The DDP hook given an integer bucket, or a state that is not a
    DDPHookState: the error text of each; and the average with state None
    (the default group's)."""
    out = {}
    state = DDPHookState(compress="always")
    for what, call in (("int64 bucket", lambda: ddp_comm_hook(state, _Bucket(torch.zeros(8, dtype=torch.int64)))),
                       ("state int", lambda: ddp_comm_hook(7, _Bucket(torch.zeros(8))))):
        try:
            call()
            out[what] = "no error"
        except (TypeError, ValueError) as e:
            out[what] = f"{type(e).__name__}: {e}"
    fut = ddp_comm_hook(state, _Bucket(torch.full((8,), float(rank + 1))))
    out["average"] = fut.wait().tolist()  # divided by world first, then summed: the mean of 1..world
    out["default"] = ddp_comm_hook(None, _Bucket(torch.full((8,), float(rank + 1)))).wait().tolist()
    state.close()
    return out


def checks(rank: int, world: int, seed: int) -> dict:
    torch.set_num_threads(1)
    return {"premul": premul_reduce_scatter(rank, world, seed), "mixed": mixed_unshard(rank, world, seed),
            "async": async_all_gather(rank, world, seed), "ddp_bad": ddp_bad_input(rank, world)}


def gpu_checks(rank: int, world: int, seed: int) -> dict:
    """On GPUs over NCCL: the reduce-scatter beside NCCL's own (2 ranks: every
    sum is a + b, so NCCL's order cannot differ), mixed-dtype unshard and
    the async all-gather."""
    dev = f"cuda:{torch.cuda.current_device()}"
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    rows = premul_reduce_scatter(rank, world, seed, dev, dtypes)
    n = 4099
    for dtype in dtypes:
        mine = _inputs(rank, world * n, dtype, seed).to(dev)
        for name, op in (("PREMUL_SUM(1/3)", dist._make_nccl_premul_sum(1 / 3)), ("AVG", dist.ReduceOp.AVG),
                         ("SUM", dist.ReduceOp.SUM)):
            want = torch.empty(n, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(want, mine.clone(), op=op)
            hook = fsdp.ReduceScatter(compress="always")
            out = torch.empty_like(want)
            hook(out, mine, dist.group.WORLD, op)
            same = torch.equal(out.view(torch.uint8), want.view(torch.uint8))
            rows.append((str(dtype), name, "vs nccl", same, True))
            hook.close()
    return {"premul": rows, "mixed": mixed_unshard(rank, world, seed, dev),
            "async": async_all_gather(rank, world, seed, dev)}
