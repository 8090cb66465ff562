"""What users see of what was compressed: pz.stats(group) per device kind
and op (the default group when none is given, {} for a group pz does not
serve), and the one-line summary PZ_STATS=1 prints at destroy_process_group
(tests/test_cluster.py checks it on two hosts)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import torch
import torch.distributed as dist

from harness.ranks import free_port, run_ranks


def _ranks(rank: int, world: int, seed: int) -> dict:
    import portable_zip as pz
    from portable_zip.c10d import Options

    g = dist.new_group(backend="pz", pg_options=Options(compress="always"))
    plain = dist.new_group(backend="gloo")
    rng = np.random.default_rng([seed, rank])
    t = torch.from_numpy(rng.standard_normal(300_000, dtype=np.float32) * 0.02).to(torch.bfloat16)
    dist.all_reduce(t, group=g)
    dist.all_reduce(torch.ones(4), group=plain)
    out = {"pz": pz.stats(g), "plain": pz.stats(plain), "default": pz.stats()}
    return out


def test_stats_per_group_and_op():
    seed = int(np.random.default_rng().integers(0, 2**31))
    res = run_ranks(2, _ranks, seed, backend="gloo", env={"PZ_CHECK_PLANS": "1"}, deadline=120)
    assert all(v[0] == "ok" for v in res.values()), res
    for rank, (_, got) in res.items():
        s = got["pz"]["cpu"]["all_reduce"]
        assert s["calls"] == 1 and s["raw_bytes"] >= 600_000 and 0 < s["wire_bytes"] < s["raw_bytes"], s
        assert s["plans"] == {"compressed": 1}, s
        assert got["plain"] == {} and got["default"] == {}, got  # gloo groups: pz moved nothing there


def test_summary_line_at_destroy_and_a_clear_error_without_a_group():
    code = textwrap.dedent("""
        import os, torch, torch.distributed as dist, portable_zip as pz
        from portable_zip.c10d import Options
        try:
            pz.stats()
        except RuntimeError as e:
            print("ERR", e)
        rank = int(os.environ["RANK"])
        dist.init_process_group("pz", pg_options=Options(compress="always"))
        dist.broadcast(torch.randn(50_000).to(torch.bfloat16), 0)
        print("STATS", sorted(pz.stats()["cpu"]))
        dist.destroy_process_group()
    """)
    env = {**os.environ, "PZ_STATS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r)}) for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "ERR pz.stats: no default process group" in out, out
        assert "STATS ['broadcast']" in out, out
        lines = [l for l in err.splitlines() if l.startswith("pz stats, group")]
        assert len(lines) == 1 and "broadcast[cpu] 1 calls" in lines[0] and "compressed" in lines[0], err
