"""Strangers on the host cannot inject data into a fabric job (issue 27): tags
are keyed by the group's secret and receives are directed at the peer's
address. Two ranks on loopback exchange fresh random tensors, raw and
compressed, while a stranger process that read rank 0's endpoint names from
the job's store (as any store client can) sends correctly formed raw and
compressed streams to rank 0: (a) from a FabricEngine posing as rank 1 with a
wrong secret, (b) from a bare libfabric client using the old, unkeyed tag
layout (tests/fabric_stranger/unkeyed_sender.c). Every received tensor must
be bit-exact and the job must finish without PeerTimeout. Also: one host
binds the endpoints to 127.0.0.1, PZ_FABRIC_IFACE picks an interface and a
bad one is a clear ValueError, and engines with different secrets never match.

PZ_STRANGER_SECONDS sets the attack's length (default 12); with
PZ_INJECTION_RESULT=path the attack's outcome is written there as JSON."""
import datetime
import json
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import comm_harness
from conftest import same_bits
from portable_zip import _C
from harness.ranks import ok

pytestmark = pytest.mark.skipif(not _C.has_fabric or bool(_C.fabric_probe()),
                                reason=f"no fabric transport here: {_C.fabric_probe()}")
TESTS = Path(__file__).resolve().parent
PROVIDER = "tcp;ofi_rxm"
SIZES = [700, 9_000, 150_000]  # bf16 elements: rxm's eager path, its limit's edge, rendezvous
MODES = ("never", "always")
ATTACK_S = float(os.environ.get("PZ_STRANGER_SECONDS", "12"))
SEND, SEND_SIZED = 0, 2  # the engine's op codes (transports/fabric.py)


def _engine(rank, world, secret, same_host=True, iface="", rails=2, chunk=2 << 20, depth=4, provider=PROVIDER):
    os.environ.setdefault("FI_HMEM", "system")
    return _C.FabricEngine(provider, rails, chunk, depth, False, -1, rank, world, same_host, 2000, secret, iface)


def _parse_address(a: bytes):
    """An engine's address(): 'PZF3', provider (32 bytes), rails, chunk, depth, name length, the rails' names."""
    assert a[:4] == b"PZF3", a[:4]
    prov = a[4:36].rstrip(b"\0").decode()
    rails, chunk, depth, nlen = struct.unpack_from("<IQII", a, 36)
    names = [a[56 + r * nlen:56 + (r + 1) * nlen] for r in range(rails)]
    return prov, rails, chunk, depth, names


def _ipv4(name: bytes) -> str:
    """The address of a sockaddr_in endpoint name (tcp, sockets)."""
    family, = struct.unpack_from("<H", name, 0)
    assert family == socket.AF_INET and len(name) >= 8, name.hex()
    return socket.inet_ntoa(name[4:8])


def test_an_engine_of_another_wire_version_is_named():
    """Rank 1's address says wire version 1 (both directions of a pair on the
    same rails): connecting names the versions, never a hang on rails that
    do not match."""
    e = _engine(0, 2, os.urandom(16))
    try:
        mine = e.address()
        with pytest.raises(ValueError, match="rank 1 runs fabric wire version 1, rank 0 version 3: run one portable_zip"):
            e.connect([mine, b"PZF1" + mine[4:]])
    finally:
        e.close()


def test_one_host_binds_every_rail_to_loopback():
    e = _engine(0, 2, os.urandom(16), same_host=True, rails=3)
    try:
        _, rails, _, _, names = _parse_address(e.address())
        assert rails == 3 and [_ipv4(n) for n in names] == ["127.0.0.1"] * 3
        info = e.info()
        assert info["bind"] == "127.0.0.1" and "127.0.0.1" in info["endpoint"], info
        assert info["keyed_tags"].startswith("yes") and info["directed_recv"].startswith("yes"), info
    finally:
        e.close()


def test_fabric_iface_picks_the_interface_and_a_bad_name_is_a_clear_error():
    from portable_zip.comm.transports.fabric import FabricTransport
    from portable_zip.comm.settings import Settings

    group = SimpleNamespace(rank=0, size=2, ranks=[0, 1], secret=os.urandom(16))
    env = {"PZ_FABRIC_PROVIDER": PROVIDER, "PZ_FABRIC_IFACE": "lo", "PZ_FABRIC_RAILS": "2"}  # every rail binds
    tp = FabricTransport(group, torch.device("cpu"), Settings.from_env(env), same_host=False)
    try:
        assert tp.info["bind"] == "127.0.0.1", tp.info
        assert [_ipv4(n) for n in _parse_address(tp.engine.address())[4]] == ["127.0.0.1"] * 2
    finally:
        tp.close()
    for same_host in (False, True):  # a typo surfaces even where loopback wins
        bad = {**env, "PZ_FABRIC_IFACE": "pz-no-such-if0"}
        with pytest.raises(ValueError, match="PZ_FABRIC_IFACE='pz-no-such-if0': no such network interface"):
            FabricTransport(group, torch.device("cpu"), Settings.from_env(bad), same_host=same_host)
    with pytest.raises(ValueError, match="secret must be 16 bytes"):
        _engine(0, 2, os.urandom(8))


@pytest.mark.parametrize("same", [True, False])
def test_engines_match_only_under_one_secret(same):
    """Two engines in one process: rank 1 sends rank 0 a random buffer; it
    arrives bit-exact under one secret and never under two."""
    s0 = os.urandom(16)
    e0, e1 = _engine(0, 2, s0), _engine(1, 2, s0 if same else os.urandom(16))
    try:
        addrs = [e0.address(), e1.address()]
        e0.connect(addrs), e1.connect(addrs)
        src = torch.from_numpy(np.random.default_rng().integers(0, 256, 100_000, dtype=np.uint8))
        dst = torch.zeros_like(src)
        rb = e0.post([(1, 1, dst.data_ptr(), dst.numel(), False)], 0)
        sb = e1.post([(SEND, 0, src.data_ptr(), src.numel(), False)], 0)
        got = e0.wait(rb, 10.0 if same else 2.0)
        if same:
            assert got == [src.numel()] and torch.equal(src, dst)
            assert e1.wait(sb, 10.0) == [src.numel()]
        else:
            assert got is None and not dst.any(), "a message under another secret matched a receive"
    finally:
        e0.close(), e1.close()


# --- the job and the stranger -------------------------------------------------

def exchange(rank, world, seed, rendezvous, min_rounds, max_s, wait_for_attack=True, rounds_at=None):
    """Rank 0 and 1 swap fresh random tensors, raw and compressed, both ways,
    until the stranger is done (at least min_rounds, at most max_s): returns
    (rounds, receives checked, receives that differed). wait_for_attack:
    rank 0 starts once the stranger attacks (else at once); rounds_at, a
    dict: gets the rounds done before the attack and during it."""
    import torch.distributed as dist

    import portable_zip as pz
    from portable_zip.comm.errors import PeerTimeout

    comms = {m: pz.Communicator(compress=m, transport="fabric", timeout=60) for m in MODES}
    rdv = Path(rendezvous)
    if rank == 0:  # the job's store: what any client of it can reach
        store = comms["never"].tp.group.store
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        (rdv / "store.tmp").write_text(json.dumps({"host": store.host, "port": store.port}))
        (rdv / "store.tmp").rename(rdv / "store.json")
        end = time.monotonic() + 120
        while wait_for_attack and not (rdv / "attacking").exists() and time.monotonic() < end:
            time.sleep(0.05)
    dist.barrier()
    start, rounds, checked, differed = time.monotonic(), 0, 0, 0
    try:
        while True:
            for mode, comm in comms.items():
                for i, numel in enumerate(SIZES):
                    case = (rounds * len(MODES) + MODES.index(mode)) * len(SIZES) + i
                    rng = np.random.default_rng([seed, 1 - rank, case])
                    expect = torch.from_numpy(rng.standard_normal(numel, dtype=np.float32) * 0.02).bfloat16()
                    mine = torch.from_numpy(np.random.default_rng([seed, rank, case])
                                            .standard_normal(numel, dtype=np.float32) * 0.02).bfloat16()
                    got = torch.empty(numel, dtype=torch.bfloat16)
                    if rank == 0:
                        comm.recv(got, 1), comm.send(mine, 1)
                    else:
                        comm.send(mine, 0), comm.recv(got, 0)
                    checked += 1
                    differed += not same_bits(got, expect)
            rounds += 1
            if rounds_at is not None:
                if (rdv / "attacking").exists():
                    rounds_at.setdefault("rounds_before_attack", rounds)
                    if not (rdv / "done").exists():
                        rounds_at["rounds_during_attack"] = rounds - rounds_at["rounds_before_attack"]
            elapsed = time.monotonic() - start
            stop = torch.tensor([rounds >= min_rounds and ((rdv / "done").exists() or elapsed > max_s)])
            dist.broadcast(stop, 0)
            if stop.item():
                break
    except PeerTimeout as e:
        raise AssertionError(f"PeerTimeout after {rounds} rounds under attack: {e}") from None
    for comm in comms.values():
        comm.close()
    return rounds, checked, differed


def stranger(rendezvous, sender, seconds):
    """Read rank 0's fabric addresses from the job's store, then for `seconds`
    send rank 0 forged streams: from engines posing as rank 1 with a wrong
    secret, and from the unkeyed sender. Prints its counts as JSON."""
    import portable_zip as pz
    from torch.distributed import TCPStore

    rdv = Path(rendezvous)
    end = time.monotonic() + 120
    while not (rdv / "store.json").exists():
        if time.monotonic() > end:
            raise SystemExit("the job never published its store")
        time.sleep(0.05)
    where = json.loads((rdv / "store.json").read_text())
    store = TCPStore(where["host"], where["port"], is_master=False, timeout=datetime.timedelta(seconds=30))
    keys = [k for k in store.list_keys() if k.endswith("/fabric/0")]
    records = [store.get(k) for k in keys]
    addrs = [r[r.index(b"PZF3"):] for r in records]  # the address is plaintext, whatever precedes it
    assert len(addrs) == 2 * len(MODES), keys  # each Communicator's engine and its point-to-point path's
    forged = [torch.full((n,), 1.5, dtype=torch.bfloat16) for n in SIZES]
    raw = [f.view(torch.uint8).clone() for f in forged] + [torch.full((64,), 7, dtype=torch.uint8)]
    streams = [pz.compress(f).view(torch.uint8).clone() for f in forged]
    files = []
    for i, t in enumerate(sorted(raw + streams, key=len)):  # eager-sized first
        files.append(rdv / f"payload{i}")
        files[-1].write_bytes(t.numpy().tobytes())
    (rdv / "attacking").touch()
    counts = {"engine_raw": 0, "engine_compressed": 0, "engine_connections": 0, "unkeyed": 0, "unkeyed_runs": 0}
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        for a in addrs:
            prov, rails, chunk, depth, names = _parse_address(a)
            e = _engine(1, 2, os.urandom(16), rails=rails, chunk=chunk, depth=depth, provider=prov)
            try:
                e.connect([a, e.address()])
                counts["engine_connections"] += 1
                ops = [(SEND, 0, t.data_ptr(), t.numel(), False) for t in raw]
                ops += [(SEND_SIZED, 0, t.data_ptr(), t.numel(), False) for t in streams]
                e.wait(e.post(ops, 0), 0.5)  # eager sends complete; rendezvous ones never match
                counts["engine_raw"] += len(raw)
                counts["engine_compressed"] += len(streams)
            finally:
                e.close()
            # rxm connects only to an endpoint of its own eager limit: the job's travels in its address.
            eager = str(struct.unpack_from("<Q", a, len(a) - 8)[0])
            out = subprocess.run([sender, prov, "1", "1024", "2", *[n.hex() for n in names], "--", *map(str, files)],
                                 capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "FI_OFI_RXM_EAGER_LIMIT": eager})
            assert out.returncode == 0, out.stderr
            counts["unkeyed"] += int(out.stdout.split()[-1])
            counts["unkeyed_runs"] += 1
    (rdv / "done").touch()
    print(json.dumps(counts))


def build_stranger(tmp_path, name: str = "unkeyed_sender") -> str:
    """tests/fabric_stranger/NAME.c, compiled against libfabric: the executable's path."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        pytest.fail("the stranger tests need a C compiler on PATH (gcc or cc, or set CC)")
    exe = tmp_path / name
    # libfabric's own flags where pkg-config knows them (headers unpacked off the system paths too)
    pc = subprocess.run(["pkg-config", "--cflags", "--libs", "libfabric"], capture_output=True, text=True) \
        if shutil.which("pkg-config") else None
    flags = pc.stdout.split() if pc is not None and pc.returncode == 0 else ["-lfabric"]
    subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Werror", str(TESTS / f"fabric_stranger/{name}.c"),
                    *flags, "-o", str(exe)], check=True)
    return str(exe)


def test_strangers_cannot_inject_data(tmp_path):
    sender = build_stranger(tmp_path)
    rdv = tmp_path / "rdv"
    rdv.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "FI_HMEM": "system", "OMP_NUM_THREADS": "1"}
    code = f"import test_fabric_strangers as t; t.stranger({str(rdv)!r}, {sender!r}, {ATTACK_S!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seed = int(np.random.default_rng().integers(0, 2**31))
    try:
        res = comm_harness.run(2, exchange, seed, str(rdv), 3, ATTACK_S + 120, env={"PZ_FABRIC_PROVIDER": PROVIDER},
                               deadline=ATTACK_S + 300)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"the stranger failed:\n{err[-4000:]}"
    counts = json.loads(out.splitlines()[-1])
    results = ok(res)
    rounds, checked, differed = results[0]
    assert results[1][0] == rounds and checked == rounds * len(MODES) * len(SIZES) == results[1][1]
    assert differed == 0 and results[1][2] == 0, f"forged data accepted: rank 0 {differed}, rank 1 {results[1][2]}"
    assert counts["engine_raw"] and counts["engine_compressed"] and counts["unkeyed"], counts
    if os.environ.get("PZ_INJECTION_RESULT"):
        lib = _engine(0, 1, os.urandom(16))
        info = lib.info()
        lib.close()
        Path(os.environ["PZ_INJECTION_RESULT"]).write_text(json.dumps({
            "what": "forged messages a stranger on the host sent rank 0 of a 2-rank fabric job while the ranks "
                    "swapped fresh random bf16 tensors (raw and compress='always') both ways, each checked bit "
                    "for bit; accepted = received tensors that differed from what the peer sent",
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()})",
            "libfabric": info["version"], "provider": info["provider"], "directed_recv": info["directed_recv"],
            "keyed_tags": info["keyed_tags"],
            "command": f"PZ_STRANGER_SECONDS={ATTACK_S:g} PZ_INJECTION_RESULT={os.environ['PZ_INJECTION_RESULT']} "
                       "pytest tests/test_fabric_strangers.py -k strangers_cannot_inject",
            "attack_seconds": ATTACK_S, "sizes_bf16_elements": SIZES,
            "forged_sent": counts, "real_rounds": rounds, "real_receives_checked": checked + results[1][1],
            "accepted": differed + results[1][2], "peer_timeouts": 0}, indent=1) + "\n")
