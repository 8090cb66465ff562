"""Training programs switched to the "pz" backend by their process group
alone (init_process_group("pz", pg_options=Options(compress=...)), nothing
else changed): DDP (2, 3 ranks; and with pz.ddp_comm_hook), FSDP2 (bf16
parameters, fp32 reduction; and with the pz.fsdp hooks), HSDP on a 2x2
mesh, and a 2-stage pipeline schedule over send/recv, >= 20 AdamW steps
each under PZ_CHECK_PLANS=1. After every step:

- replicas are bit-identical;
- compress="always" is bit-identical to compress="never" (compression
  changes no bit), and "always" really compressed (its groups' .stats:
  wire bytes < raw bytes, "compressed" plans for every reduction and for
  the pipeline's sends);
- against the same program on plain gloo: bit-identical where every
  reduction adds two terms (2 ranks, the 2x2 mesh) and for the pipeline
  (send/recv only); with three terms (3-rank DDP) the rank order rounds
  differently, so tests/test_hooks.py's tolerance applies: all but 1 in
  10^4 values of the first step within 1e-6, losses within 1e-5 relative, parameters within 1e-4 relative
  L2 distance. compress="auto" is held to the same, as it may run gloo's
  own reduction for some sizes.
"""
import numpy as np
import pytest

import dropin_workers
from harness.ranks import run_ranks
from harness.training import Run, run_training
from test_hooks import MP, _close

ENV = {"PZ_CHECK_PLANS": "1", "OMP_NUM_THREADS": "1"}  # CI sets PZ_CHECK_PLANS for the suite; set here anyway
STEPS = 20
# The ops each program's training moves, by the name of the group that moves them (group_stats).
DDP_OPS = {"dp": ("all_reduce",)}
FSDP_OPS = {"shard": ("all_gather", "reduce_scatter")}
HSDP_OPS = {"dp": ("all_reduce",), "shard": ("all_gather", "reduce_scatter")}
PIPE_OPS = {"world": ("send",)}


def pz_runs(wrapping: str, modes=("never", "always", "auto"), **kw):
    """The program on plain gloo, then on "pz" in each mode (never first)."""
    return [Run(wrapping, backend="gloo", **kw)] + [Run(wrapping, backend="pz", compress=m, **kw) for m in modes]


def check(res: dict, world: int, runs: list, ops: dict, exact: bool, replicated: bool = True):
    """runs[0] is the plain backend (gloo, NCCL), runs[1] pz compress="never" (see the module's doc)."""
    plain, never = 0, 1
    assert runs[plain].backend != "pz" and runs[never].backend == "pz" and runs[never].compress == "never"
    for i, run in enumerate(runs):
        fps = [res[r][i]["fingerprints"] for r in range(world)]
        assert len(fps[0]) == run.steps >= STEPS
        if replicated:
            assert all(f == fps[0] for f in fps), f"{run}: ranks' parameters differ"
        if run.backend == "pz":
            for r in range(world):
                _check_stats(run, res[r][i]["group_stats"], ops)
        if run.compress == "always":  # compression changes no bit
            assert all(res[r][i]["fingerprints"] == res[r][never]["fingerprints"] for r in range(world)), \
                f"{run} differs from compress='never'"
        for r in range(world):
            if exact:
                assert res[r][i]["fingerprints"] == res[r][plain]["fingerprints"], \
                    f"rank {r}: {run} differs from {runs[plain]}"
            elif i != plain and res[r][i]["values"]:
                _close(res[r][plain], res[r][i])


def _check_stats(run: Run, stats: dict, ops: dict):
    for group, names in ops.items():
        assert group in stats, f"{run}: no stats from group {group!r}: {stats}"
        for op in names:
            s = stats[group]["cpu" if run.device == "cpu" else "cuda"].get(op)
            assert s and s["calls"] >= run.steps, (run, group, op, s)
            plans = s["plans"]
            if run.compress == "always":  # compression really happened
                assert s["wire_bytes"] < s["raw_bytes"], (run, group, op, s)
                assert plans.get("compressed", 0) >= run.steps, (run, group, op, s)
                if op in ("all_reduce", "reduce_scatter"):  # float gradients only: every one coded
                    assert set(plans) == {"compressed"}, (run, group, op, s)
            elif run.compress == "never":
                assert "compressed" not in plans and s["wire_bytes"] == s["raw_bytes"], (run, group, op, s)


def train(world, runs, **kw):
    return run_training(world, runs, backend="pz", env=ENV, **kw)


def test_ddp_two_ranks():
    runs = pz_runs("ddp", steps=STEPS)
    check(train(2, runs), 2, runs, DDP_OPS, exact=True)


def test_ddp_three_ranks():
    runs = pz_runs("ddp", steps=STEPS)
    check(train(3, runs), 3, runs, DDP_OPS, exact=False)


def test_ddp_with_the_pz_hook():
    """pz.ddp_comm_hook on DDP over the pz world: the hook's own Communicator
    over a pz group."""
    runs = [Run("ddp", backend="gloo", steps=STEPS)] + [
        Run("ddp_hook", backend="pz", compress=m, steps=STEPS) for m in ("never", "always")]
    res = train(2, runs)
    check(res, 2, runs, {}, exact=True)
    s = res[0][2]["stats"]["all_reduce"]  # the hook's Communicator's
    assert s["calls"] >= STEPS and s["wire_bytes"] < s["raw_bytes"] and set(s["plans"]) == {"compressed"}, s


def test_fsdp2_two_ranks():
    runs = pz_runs("fsdp", steps=STEPS, **MP)
    check(train(2, runs), 2, runs, FSDP_OPS, exact=True)


def test_fsdp2_with_the_pz_hooks():
    runs = [Run("fsdp", backend="gloo", steps=STEPS, **MP)] + [
        Run("fsdp_hook", backend="pz", compress=m, steps=STEPS, **MP) for m in ("never", "always")]
    res = train(2, runs)
    check(res, 2, runs, {}, exact=True)
    for op, s in res[0][2]["stats"].items():  # the hooks' Communicators'
        assert s["calls"] >= STEPS and s["wire_bytes"] < s["raw_bytes"] and "compressed" in s["plans"], (op, s)


def test_hsdp_2x2_mesh():
    """init_device_mesh("cpu", (2, 2), ("dp", "shard")), each dim given
    ("pz", Options(...)) through backend_override."""
    runs = pz_runs("hsdp", steps=STEPS, **MP)
    check(train(4, runs), 4, runs, HSDP_OPS, exact=True)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_two_stages(schedule):
    """Each stage's parameters after every step: send/recv moves bytes, so
    every mode is bit-identical to gloo; the loss falls."""
    modes = ("never", "always", "auto") if schedule == "1f1b" else ("never", "always")
    runs = pz_runs(schedule, modes=modes, steps=STEPS)
    res = run_ranks(2, dropin_workers.pipeline, runs, backend="pz", env=ENV, deadline=300)
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, bad
    res = {r: v[1] for r, v in res.items()}
    check(res, 2, runs, PIPE_OPS, exact=True, replicated=False)
    for i, run in enumerate(runs):
        losses = np.mean(res[1][i]["losses"], axis=1)
        assert len(res[1][i]["losses"][0]) == dropin_workers.MICROBATCHES
        assert losses[-3:].mean() < losses[:3].mean(), f"{run}: did not train: {losses}"
        assert res[0][i]["fingerprints"][-1] != res[0][i]["fingerprints"][0], f"{run}: stage 0 never updated"
    for r in range(2):  # every microbatch's activation (rank 0) or its gradient (rank 1), compressed
        s = res[r][2]["group_stats"]["world"]["cpu"]["send"]
        assert s["plans"].get("compressed", 0) >= STEPS * dropin_workers.MICROBATCHES, s
