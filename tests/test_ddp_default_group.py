"""ddp.register_comm_hook(None, pz.ddp_comm_hook): state None is the
default group, as in torch's default_hooks. Trained over gloo and over the
pz world, it matches plain DDP bit for bit (two ranks: every sum is a + b)
and its all-reduces go through the default state's Communicator."""
import torch.distributed as dist

from harness import training
from harness.training import Run, Wrapped, wrapping

STEPS = 12


@wrapping("ddp_hook_none")
def _ddp_hook_none(model, run):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import portable_zip as pz
    from portable_zip import ddp

    m = DDP(model, bucket_cap_mb=training.BUCKET_MB)
    m.register_comm_hook(None, pz.ddp_comm_hook)
    return Wrapped(m, lambda: ddp._default_state().stats, groups=lambda: {"dp": dist.group.WORLD})


def train(rank, world, runs):
    """harness.training.train, in a rank that has imported this module (its wrapping)."""
    return training.train(rank, world, runs)


def test_state_none_is_the_default_group():
    runs = [Run("ddp", steps=STEPS), Run("ddp_hook_none", steps=STEPS),
            Run("ddp", backend="pz", compress="always", steps=STEPS),
            Run("ddp_hook_none", backend="pz", compress="always", steps=STEPS)]
    res = training.run_ranks(2, train, runs, env={"OMP_NUM_THREADS": "1"}, backend="gloo", deadline=300)
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, bad
    for r in range(2):
        out = res[r][1]
        plain = out[0]["fingerprints"]
        assert len(plain) == STEPS and all(o["fingerprints"] == plain for o in out), f"rank {r} differs"
        for i in (1, 3):  # the hook's own Communicator carried every bucket
            s = out[i]["stats"]["all_reduce"]
            assert s["calls"] >= STEPS and s["raw_bytes"] > 0, (runs[i], s)

