"""pz.ddp_comm_hook and pz.fsdp.AllGather/ReduceScatter in real training
loops on gloo (tests/harness/training.py: a 2-layer transformer, AdamW,
20 steps), under PZ_CHECK_PLANS=1. After every step: replicas bit-identical,
every compress mode bit-identical to compress="never", and each hook run
against the same run without hooks:

- bit-identical wherever every reduction sums two terms (2-rank DDP and
  FSDP2, HSDP's 2x2 mesh): a + b is the same in any order, and AVG's
  division by 2 is exact, so pz and torch agree to the bit;
- with three or four terms pz's rank order and gloo's order round
  differently (an ulp of the gradient). AdamW's first update from identical
  parameters then differs by at most 1e-6 (an ulp or two of the parameters)
  except where a gradient's terms nearly cancel: at most 1 value in 10^4
  (measured: 1-3 of 117,504 on one 2-core VM, none on another); later, Adam's division by sqrt(v) amplifies ulp differences of near-zero
  gradients and they compound, so the check is the losses (to 1e-5
  relative) and the parameters (relative L2 distance at most 1e-4; measured
  1.4e-5 after 20 steps at 3 ranks).
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import hook_workers
from harness.training import Run, run_training
from portable_zip import fsdp
from portable_zip.ddp import DDPHookState, ddp_comm_hook

ENV = {"PZ_CHECK_PLANS": "1"}  # CI sets it for the whole suite; these tests set it anyway
MP = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # FSDP2 mixed precision: bf16 all-gathers


def _check_modes(res, world, runs, plain: int, exact: bool):
    """runs[plain] is the run without hooks; the others are hook runs, the first of them compress="never"."""
    hooks = [i for i in range(len(runs)) if i != plain]
    never = hooks[0]
    assert runs[never].compress == "never"
    for i, run in enumerate(runs):
        fps = [res[r][i]["fingerprints"] for r in range(world)]
        assert len(fps[0]) == run.steps >= 20
        assert all(f == fps[0] for f in fps), f"{run}: ranks' parameters differ"
        losses = res[0][i]["losses"]
        assert losses[-1] < losses[0], f"{run}: did not train: {losses}"
        if i in hooks:
            assert res[0][i]["fingerprints"] == res[0][never]["fingerprints"], f"{run} differs from compress='never'"
            _check_stats(run, res[0][i]["stats"])
    for i in hooks:
        if exact:
            assert res[0][i]["fingerprints"] == res[0][plain]["fingerprints"], f"{runs[i]} differs from {runs[plain]}"
        else:
            _close(res[0][plain], res[0][i])


def _check_stats(run: Run, stats: dict):
    assert stats, f"{run}: the hooks never ran"
    for op, s in stats.items():
        assert s["calls"] >= run.steps
        if run.compress == "always":  # compression surely happened, and paid
            assert s["plans"] == {"compressed": s["calls"]}, (op, s)
            assert s["wire_bytes"] < s["raw_bytes"], (op, s)
        elif run.compress == "never":
            assert s["plans"] == {"raw": s["calls"]} and s["wire_bytes"] == s["raw_bytes"], (op, s)


def _close(plain: dict, hooked: dict):
    # Another order of a 3-term sum rounds differently; AdamW's first step
    # (lr times about g/|g|) magnifies that only where the terms nearly cancel
    # (|g| near eps): a handful of values, which ones depends on the CPU's
    # kernels. Wrong data moves most values by about lr (3e-3).
    d = np.abs(plain["values"][0] - hooked["values"][0])
    off = int((d > 1e-6).sum())
    assert off <= d.size // 10_000, f"first step: {off} of {d.size} values differ by > 1e-6 (max {d.max()})"
    np.testing.assert_allclose(hooked["losses"], plain["losses"], rtol=1e-5)
    for step, (a, b) in enumerate(zip(plain["values"], hooked["values"])):
        rel = np.linalg.norm(a - b) / np.linalg.norm(a)
        assert rel <= 1e-4, f"step {step}: relative L2 distance {rel}"


def test_ddp_hook_two_ranks_bit_identical_to_ddp():
    runs = [Run("ddp"), Run("ddp_hook", compress="never"), Run("ddp_hook", compress="always"),
            Run("ddp_hook", compress="auto")]
    _check_modes(run_training(2, runs, env=ENV), 2, runs, plain=0, exact=True)


def test_ddp_hook_three_ranks():
    runs = [Run("ddp"), Run("ddp_hook", compress="never"), Run("ddp_hook", compress="always")]
    _check_modes(run_training(3, runs, env=ENV), 3, runs, plain=0, exact=False)


def test_fsdp_hooks_two_ranks_bit_identical_to_fsdp():
    runs = [Run("fsdp", **MP), Run("fsdp_hook", compress="never", **MP), Run("fsdp_hook", compress="always", **MP),
            Run("fsdp_hook", compress="auto", **MP)]
    _check_modes(run_training(2, runs, env=ENV), 2, runs, plain=0, exact=True)


def test_fsdp_hooks_gradient_divide_factor():
    """set_gradient_divide_factor(4) on 2 ranks makes FSDP2 pass PREMUL_SUM(1/4);
    gloo has no PREMUL_SUM, so the plain run sums and divides after
    (force_sum): a power of two scales exactly either way, so the bits match."""
    runs = [Run("fsdp", divide_factor=4.0, force_sum=True, **MP),
            Run("fsdp_hook", compress="never", divide_factor=4.0, **MP),
            Run("fsdp_hook", compress="always", divide_factor=4.0, **MP)]
    _check_modes(run_training(2, runs, env=ENV), 2, runs, plain=0, exact=True)


def test_fsdp_hooks_four_ranks():
    runs = [Run("fsdp", **MP), Run("fsdp_hook", compress="never", **MP), Run("fsdp_hook", compress="always", **MP)]
    _check_modes(run_training(4, runs, env=ENV), 4, runs, plain=0, exact=False)


def test_hsdp_hooks_2x2_mesh():
    """Hooks on the shard dim; the replicate all-reduce is FSDP2's own."""
    runs = [Run("hsdp", **MP), Run("hsdp_hook", compress="never", **MP), Run("hsdp_hook", compress="always", **MP)]
    _check_modes(run_training(4, runs, env=ENV), 4, runs, plain=0, exact=True)


def test_hooks_called_directly():
    """PREMUL_SUM, AVG and SUM reduce-scatters against their definition (3
    ranks: rank order matters), FSDP2's mixed-dtype (uint8) unshard, blocking
    and async, async handles, and the DDP hook's bad input."""
    from harness.ranks import run_ranks
    seed = int(np.random.default_rng().integers(0, 2**31))
    res = run_ranks(3, hook_workers.checks, seed, backend="gloo", env=ENV, deadline=300)
    for r, (status, out) in res.items():
        assert status == "ok", (r, status, out)
        assert len(out["premul"]) == 12 and all(same and kept for *_, same, kept in out["premul"]), out["premul"]
        mixed = out["mixed"]
        assert mixed["blocking"] and mixed["async"], mixed
        raw, wire, plans = mixed["stats"]
        assert raw > 0 and wire >= raw and "compressed" not in plans, mixed  # a uint8 buffer moves raw
        assert out["async"]
        bad = out["ddp_bad"]
        assert "SUM" in bad["int64 bucket"] and "torch.int64" in bad["int64 bucket"], bad
        assert bad["state int"].startswith("TypeError") and "DDPHookState" in bad["state int"], bad
        assert bad["average"] == [2.0] * 8, bad  # (1 + 2 + 3) / 3 on every rank
        assert bad["default"] == [2.0] * 8, bad  # state None: the default group's, as torch's hooks take it


@pytest.mark.parametrize("dtype,op,err,names", [
    (torch.int32, dist.ReduceOp.SUM, TypeError, ("SUM", "torch.int32")),
    (torch.uint8, dist.ReduceOp.AVG, TypeError, ("AVG", "torch.uint8")),
    (torch.float32, dist.ReduceOp.PRODUCT, ValueError, ("PRODUCT", "torch.float32")),
    (torch.bfloat16, dist.ReduceOp.BXOR, ValueError, ("BXOR", "torch.bfloat16")),
])
def test_reduce_scatter_refuses_what_it_cannot_serve(dtype, op, err, names):
    """Checked before any group is touched: no process group here at all."""
    hook = fsdp.ReduceScatter(compress="always")
    with pytest.raises(err) as e:
        hook(torch.empty(4, dtype=dtype), torch.empty(8, dtype=dtype), None, op)
    assert all(n in str(e.value) for n in names), str(e.value)


def test_hook_options_checked_when_made():
    with pytest.raises(ValueError, match="compress"):
        fsdp.AllGather(compress="sometimes")
    with pytest.raises(TypeError, match="link_gpbs"):
        fsdp.ReduceScatter(link_gpbs=100)
    with pytest.raises(ValueError, match="compress"):
        DDPHookState(compress="maybe")
    with pytest.raises(TypeError, match="DDPHookState"):
        ddp_comm_hook(object(), None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_premultiplied_is_nccls_premul(dtype):
    """NCCL's PreMulSum: the factor rounded to the dtype, then one correctly
    rounded product (exact in fp64 for every dtype here)."""
    t = (torch.randn(100_000, dtype=torch.float64) * 10.0 ** torch.randint(-6, 6, (100_000,))).to(dtype)
    for f in (1 / 3, 0.1, 1 / 6, 2.5e-3):
        want = (t.double() * float(torch.tensor(f, dtype=torch.float64).to(dtype))).to(dtype)
        got = fsdp.premultiplied(t, f)
        assert got.dtype == dtype and torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
