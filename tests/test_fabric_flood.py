"""A connection flood ends no fabric job (issue 36): two ranks swap fresh
random tensors (raw and compressed, checked bit for bit, as
tests/test_fabric_strangers.py's job does) while a stranger that read their
endpoint names from the job's store opens and drops connections to them as
fast as it can (tests/fabric_stranger/flood.c): >= 1,000 in at most 25 s.
Every receive must be exact, no rank may raise, and the job must keep
moving; the rounds per second with and without the flood are printed
(bench/results/h100host-fabric-flood.json records a run, before and after).

PZ_FLOOD_CONNECTIONS and PZ_FLOOD_SECONDS set the flood (default 1000, 25)."""
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import comm_harness
import test_fabric_strangers as strangers
from portable_zip import _C
from harness.ranks import ok

pytestmark = pytest.mark.skipif(not _C.has_fabric or bool(_C.fabric_probe()),
                                reason=f"no fabric transport here: {_C.fabric_probe()}")
CONNECTIONS = int(os.environ.get("PZ_FLOOD_CONNECTIONS", "1000"))
SECONDS = float(os.environ.get("PZ_FLOOD_SECONDS", "25"))


def flooder(rendezvous: str, exe: str, connections: int, seconds: float) -> None:
    """Wait for the job's store, read every rank's fabric names from it, flood them. Prints JSON."""
    import datetime

    from torch.distributed import TCPStore

    rdv = Path(rendezvous)
    end = time.monotonic() + 120
    while not (rdv / "store.json").exists():
        if time.monotonic() > end:
            raise SystemExit("the job never published its store")
        time.sleep(0.05)
    where = json.loads((rdv / "store.json").read_text())
    store = TCPStore(where["host"], where["port"], is_master=False, timeout=datetime.timedelta(seconds=30))
    records = [store.get(k) for k in store.list_keys() if re.search(r"/fabric/\d+$", k)]
    names, prov = [], None
    for r in records:
        prov, _, _, _, ns = strangers._parse_address(r[r.index(b"PZF3"):])
        names += [n.hex() for n in ns]
    # A quiet baseline first: the job's rounds before any stranger.
    time.sleep(3.0)
    (rdv / "attacking").touch()
    t0 = time.monotonic()
    out = subprocess.run([exe, prov, str(-(-connections // len(names))), str(seconds), *names],
                         capture_output=True, text=True, timeout=seconds + 60)
    took = time.monotonic() - t0
    (rdv / "done").touch()
    assert out.returncode == 0, out.stderr
    print(json.dumps({"connections": int(out.stdout.split()[-1]), "seconds": took, "names": len(names)}))


def job(rank, world, seed, rendezvous, max_s):
    """strangers.exchange, timed: rounds per second before the flood and during it."""
    rdv = Path(rendezvous)
    import threading
    marks = {}

    def watch():
        while not (rdv / "attacking").exists():
            time.sleep(0.01)
        marks["attack"] = time.monotonic()
        while not (rdv / "done").exists():
            time.sleep(0.01)
        marks["done"] = time.monotonic()

    threading.Thread(target=watch, daemon=True).start()
    t0 = time.monotonic()
    rounds, checked, differed = strangers.exchange(rank, world, seed, rendezvous, 3, max_s, wait_for_attack=False,
                                                   rounds_at=marks)
    return rounds, checked, differed, marks.get("rounds_before_attack", 0), marks.get("attack", t0) - t0, \
        marks.get("rounds_during_attack", rounds), marks.get("done", time.monotonic()) - marks.get("attack", t0)


def test_a_connection_flood_ends_no_job(tmp_path):
    exe = strangers.build_stranger(tmp_path, "flood")
    rdv = tmp_path / "rdv"
    rdv.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(strangers.TESTS), os.environ.get("PYTHONPATH", "")]),
           "FI_HMEM": "system", "OMP_NUM_THREADS": "1"}
    code = f"import test_fabric_flood as t; t.flooder({str(rdv)!r}, {exe!r}, {CONNECTIONS}, {SECONDS!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seed = int(np.random.default_rng().integers(0, 2**31))
    try:
        res = comm_harness.run(2, job, seed, str(rdv), SECONDS + 90,
                               env={"PZ_FABRIC_PROVIDER": strangers.PROVIDER}, deadline=SECONDS + 240)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"the flood failed:\n{err[-4000:]}"
    flood = json.loads(out.splitlines()[-1])
    results = ok(res)
    rounds, checked, differed, before, before_s, during, during_s = results[0]
    assert differed == 0 and results[1][2] == 0, "a receive differed from what the peer sent"
    assert flood["connections"] >= min(CONNECTIONS, 1000) or flood["seconds"] >= SECONDS, flood
    assert during > 0, f"no round finished during the flood ({flood})"
    rate = (before / before_s, during / max(during_s, 1e-9))
    print(f"flood: {flood['connections']} connections in {flood['seconds']:.1f} s; job: {rate[0]:.1f} "
          f"rounds/s before, {rate[1]:.1f} during")
    if os.environ.get("PZ_FLOOD_RESULT"):
        Path(os.environ["PZ_FLOOD_RESULT"]).write_text(json.dumps({
            "what": "a 2-rank fabric job (tcp;ofi_rxm on loopback) swapping fresh random bf16 tensors, raw and "
                    "compressed, both ways, checked bit for bit, while a stranger that read the ranks' endpoint "
                    "names from the job's store opened and dropped connections to them (tests/fabric_stranger/"
                    "flood.c); rounds/s before the flood and during it",
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()})",
            "command": f"PZ_FLOOD_RESULT={os.environ['PZ_FLOOD_RESULT']} pytest -s tests/test_fabric_flood.py",
            "flood": flood, "rounds_before": before, "seconds_before": before_s, "rounds_during": during,
            "seconds_during": during_s, "rounds_per_s_before": rate[0], "rounds_per_s_during": rate[1],
            "receives_checked": checked + results[1][1], "receives_wrong": 0, "peer_errors": 0}, indent=1) + "\n")
