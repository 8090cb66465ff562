"""Per-rank bodies of the pz.weights tests (importable by forked ranks).

Every rank rebuilds every tensor of every version from (seed, name, version),
so each receiver checks its result bit for bit against what it can compute."""
import os
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

import portable_zip as pz
from portable_zip.comm.errors import MismatchError
from portable_zip.weights import engine
from conftest import same_bits as same

SHAPES = {"embed": (50, 24), "layer.0.w": (40, 33), "layer.0.b": (33,), "layer.1.w": (37, 40),
          "norm": (24,), "step": (), "ids": (7, 3), "empty": (0, 5)}
DTYPES = {"embed": torch.bfloat16, "layer.0.w": torch.bfloat16, "layer.0.b": torch.float32,
          "layer.1.w": torch.float16, "norm": torch.bfloat16, "step": torch.float32, "ids": torch.int64,
          "empty": torch.bfloat16}


def weight(seed, name, version, shape=None, dtype=None):
    """Version `version` of a weight: a base plus small steps that change a
    few percent of the 16-bit values each version (like AdamW at a low lr)."""
    shape, dtype = shape or SHAPES[name], dtype or DTYPES[name]
    rng = np.random.default_rng([seed, sum(map(ord, name))])
    n = int(np.prod(shape))
    if dtype == torch.int64:
        return torch.from_numpy(rng.integers(0, 1000, n) + version).reshape(shape)
    v = rng.standard_normal(n).astype(np.float32) * 0.05
    for k in range(1, version + 1):
        step = np.random.default_rng([seed, sum(map(ord, name)), k]).standard_normal(n).astype(np.float32)
        v = v + step * 2e-5
    return torch.from_numpy(v).reshape(shape).to(dtype)


def dev():
    """PZ_TEST_WEIGHTS_DEVICE where set (ranks sharing one GPU over the fabric),
    else cuda:<this rank's GPU> on NCCL jobs, else the CPU."""
    if os.environ.get("PZ_TEST_WEIGHTS_DEVICE"):
        return torch.device(os.environ["PZ_TEST_WEIGHTS_DEVICE"])
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def communicator(group=None, timeout=30.0):
    """The job's Communicator; over the fabric, on dev(), where PZ_TEST_WEIGHTS_FABRIC=1."""
    kw = {"transport": "fabric", "device": dev()} if os.environ.get("PZ_TEST_WEIGHTS_FABRIC") == "1" else {}
    return pz.Communicator(group=group, compress="always", timeout=timeout, **kw)


def model(seed, version, names=None):
    return {n: weight(seed, n, version).to(dev()) for n in (names or SHAPES)}


def buffers(names=None):
    """Zeroed receive buffers for every weight (or `names`)."""
    return {n: torch.zeros(SHAPES[n], dtype=DTYPES[n], device=dev()) for n in (names or SHAPES)}


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def check_model(into, seed, version, rows=None):
    """into[name] is version `version` (or its rows [a, b) where rows says)."""
    for n, t in into.items():
        want = weight(seed, n, version)
        if rows and n in rows:
            want = want[rows[n][0]:rows[n][1]]
        check(same(t.cpu(), want), f"{n} differs from version {version}")


def use_delta():
    """Which delta codec the engine runs: the package's own (pz.delta)."""
    return "real" if engine.codec_delta is pz.delta else "other"


def comm_of(ranks, timeout=30.0):
    """A Communicator over `ranks` (every rank must call new_group; only members construct)."""
    g = dist.new_group(ranks)
    return communicator(g, timeout) if dist.get_rank() in ranks else None


def one_to_many(rank, world, seed, rounds, bucket_bytes):
    """Rank 0 sends, the others receive into dicts, `rounds` versions."""
    impl = use_delta()
    comm = communicator()
    if rank == 0:
        s = engine.Sender(comm, bucket_bytes=bucket_bytes, keep_base="cpu")
        coders, payload = [], s._payload
        s._payload = lambda part, c: (coders.append(threading.current_thread().name), payload(part, c))[1]
        stats = [s.send(model(seed, v).items(), v) for v in range(rounds)]
        # a CPU sender codes the first bucket on the caller's thread, the next ones ahead on one more
        # (a GPU sender codes inline: its stream orders the work); none outlives a round
        want = {threading.main_thread().name} | ({"pz-weights-code_0"} if dev().type == "cpu" else set())
        check(set(coders) == want, f"coded on {set(coders)}")
        check(not [t for t in threading.enumerate() if t.name.startswith("pz-weights-code")], "a coder outlived send")
    else:
        r = engine.Receiver(comm)
        into = buffers()
        stats = []
        for v in range(rounds):
            stats.append(r.receive(into))
            check_model(into, seed, v)
    return impl, [[{k: p[k] for k in ("delta", "full", "repaired", "fallbacks", "buckets")} for p in st]
                  for st in stats]


def skew(rank, world, seed):
    """World 4. Round 0 over {0,1,2}; round 1 over {0,1} (rank 2 misses it);
    rounds 2 and 3 over {0,1,2,3} (rank 3 joins late)."""
    impl = use_delta()
    groups = [[0, 1, 2], [0, 1], [0, 1, 2, 3], [0, 1, 2, 3]]
    comms = [comm_of(g) for g in groups]  # every rank calls new_group in the same order
    eng = into = None
    stats = {}
    for v, (g, comm) in enumerate(zip(groups, comms)):
        if rank not in g:
            continue
        if eng is None:
            eng = engine.Sender(comm, bucket_bytes=1 << 20) if rank == 0 else engine.Receiver(comm)
            into = buffers()
        eng.comm = comm
        if rank == 0:
            st = eng.send(model(seed, v), v)
        else:
            st = eng.receive(into)
            check_model(into, seed, v)
        stats[v] = [{k: p[k] for k in ("delta", "full", "fallbacks")} for p in st]
    return impl, stats


def sharded(rank, world, seed, rounds, part_bytes):
    """World 4: ranks 0 and 1 each hold half the rows of every 2-D weight (and
    both hold the 1-D ones: replicas); rank 2 wants rows [0, 3/4) and rank 3
    rows [1/4, end) of every 2-D weight, and the whole 1-D ones. Deltas after
    the first round; sends in parts of part_bytes."""
    impl = use_delta()
    comm = communicator()
    names = ["embed", "layer.0.w", "layer.0.b", "layer.1.w", "norm"]
    two_d = [n for n in names if len(SHAPES[n]) == 2]
    stats = []
    if rank < 2:
        s = engine.Sender(comm, bucket_bytes=700, part_bytes=part_bytes)
        for v in range(rounds):
            full = model(seed, v, names)
            mine, shards = {}, {}
            for n, t in full.items():
                if n in two_d:
                    h = t.shape[0] // 2
                    a, b = (0, h) if rank == 0 else (h, t.shape[0])
                    mine[n], shards[n] = t[a:b].clone(), (a, t.shape[0])
                else:
                    mine[n] = t
            stats.append(s.send(((n, t) for n, t in mine.items()), v, shards=shards))
    else:
        r = engine.Receiver(comm)
        rows = {n: ((0, SHAPES[n][0] * 3 // 4) if rank == 2 else (SHAPES[n][0] // 4, SHAPES[n][0])) for n in two_d}
        into = {n: torch.zeros((rows[n][1] - rows[n][0], *SHAPES[n][1:]) if n in rows else SHAPES[n],
                               dtype=DTYPES[n], device=dev()) for n in names}
        shards = {n: (rows[n][0], SHAPES[n][0]) for n in rows}
        for v in range(rounds):
            stats.append(r.receive(into, shards=shards))
            check_model(into, seed, v, rows)
    return impl, [[{k: p[k] for k in ("delta", "full", "chunks")} for p in st] for st in stats]


def callback(rank, world, seed, rounds, keep_base):
    """Rank 0 sends; rank 1 receives through a load_weights callable (vLLM style)."""
    impl = use_delta()
    comm = communicator()
    if rank == 0:
        s = engine.Sender(comm, bucket_bytes=2000)
        return impl, [s.send(model(seed, v), v)[0]["delta"] for v in range(rounds)]
    r = engine.Receiver(comm, keep_base=keep_base)
    out = []
    for v in range(rounds):
        loaded, calls = {}, []

        def load_weights(pairs):
            calls.append([n for n, _ in pairs])
            for n, t in pairs:
                check(n not in loaded, f"{n} loaded twice")
                loaded[n] = t.clone()

        st = r.receive(load_weights)
        check(sorted(loaded) == sorted(SHAPES), f"loaded {sorted(loaded)}")
        check_model(loaded, seed, v)
        out.append((st[0]["delta"], len(calls)))
    return impl, out


def corrupt(rank, world, seed):
    """Round 1's delta of layer.0.w has a flipped byte: the receivers repair it
    with a full resend in the same round and end bit-exact."""
    impl = use_delta()
    comm = communicator()
    if rank == 0:
        s = engine.Sender(comm)
        s.send(model(seed, 0), 0)

        def flip(name, stream):
            if name == "layer.0.w":
                stream[stream.numel() // 2] ^= 0x5A
                stream[-1] ^= 0x01

        engine._corrupt = flip
        st = s.send(model(seed, 1), 1)
        engine._corrupt = None
        st += s.send(model(seed, 2), 2)
        return impl, [(p["repaired"], p["repairs"]) for p in st]
    r = engine.Receiver(comm)
    into = buffers()
    out = []
    for v in range(3):
        st = r.receive(into)
        check_model(into, seed, v)
        out.append((st[0]["repaired"], st[0]["repairs"], st[0]["delta"]))
    return impl, out


def mismatch(rank, world, kind):
    """Receivers whose buffers disagree with what rank 0 sends: MismatchError on every rank."""
    comm = communicator(timeout=20)
    seed = 5
    t0 = time.monotonic()
    try:
        if rank == 0:
            engine.Sender(comm).send(model(seed, 0), 0)
        else:
            into = buffers()
            if kind == "shape" and rank == world - 1:
                into["layer.0.w"] = torch.zeros(40, 32, dtype=torch.bfloat16)
            elif kind == "dtype":
                into["norm"] = torch.zeros(24, dtype=torch.float16)
            elif kind == "extra_name":
                into["missing"] = torch.zeros(3)
            elif kind == "unwanted_name":
                del into["layer.1.w"]
            engine.Receiver(comm).receive(into)
    except MismatchError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "returned", "", time.monotonic() - t0


def killed(rank, world, victim, timeout):
    """Rank `victim` dies in round 1 (after its manifest swap); the others raise within the timeout."""
    use_delta()
    comm = communicator(timeout=timeout)
    seed = 9
    big = {"w": torch.randn(256, 1024).to(torch.bfloat16)}
    eng = engine.Sender(comm, bucket_bytes=64 << 10) if rank == 0 else engine.Receiver(comm)
    into = {"w": torch.zeros(256, 1024, dtype=torch.bfloat16)}
    eng.send(big, 0) if rank == 0 else eng.receive(into)
    if rank == victim:
        real = engine._Engine._bucket

        def die(self, *a, **k):
            os._exit(0)

        engine._Engine._bucket = die
        del real
    t0 = time.monotonic()
    try:
        eng.send({"w": big["w"] + 1}, 1) if rank == 0 else eng.receive(into)
    except pz.PeerError as e:
        return type(e).__name__, time.monotonic() - t0, str(e)[:300]
    return "returned", time.monotonic() - t0, ""


class RpcClient:
    """vLLM's 4-method client protocol, its calls carried to the worker ranks
    over the test's own torch.distributed world (as Ray or HTTP would): each
    call blocks until every worker is done and raises a worker's error."""

    def _call(self, method, *args):
        dist.broadcast_object_list([(method, args)], src=0)
        errors = [None] * dist.get_world_size()
        dist.gather_object(None, errors, dst=0)
        bad = [e for e in errors[1:] if e]
        if bad:
            raise RuntimeError(f"{method} failed on a worker: {bad[0]}")

    def init_weight_transfer_engine(self, init_info):
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self):
        self._call("start_weight_update")

    def update_weights(self, update_info):
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version=None):
        self._call("finish_weight_update")

    def stop(self):
        self._call("shutdown_weight_transfer_engine")


def vllm_e2e(rank, world, seed, rounds, keep_base):
    """Rank 0 is the trainer (pz.weights.vllm.Trainer over RpcClient); the
    others are vLLM workers (fake_vllm.Worker, TP rank = rank - 1) whose
    engine the factory builds by the registered name."""
    import fake_vllm
    import portable_zip.weights.vllm as pzv

    impl = use_delta()
    fake_vllm.install()
    pzv.register()
    pzv.register()  # a plugin may run twice: no error
    try:
        fake_vllm.WeightTransferEngineFactory.register_engine(pzv.BACKEND, object)
        raise AssertionError("the factory accepted a duplicate name")
    except ValueError:
        pass
    if rank == 0:
        client = RpcClient()
        trainer = pzv.Trainer(client, world_size=world, master_address="127.0.0.1", timeout=30, keep_base=keep_base,
                              compress="always", bucket_bytes=2000)
        deltas = [sum(p["delta"] for p in trainer.send_weights(model(seed, v).items(), v)) for v in range(rounds)]
        client.stop()
        trainer.shutdown()
        return impl, deltas
    worker = fake_vllm.Worker(pzv.BACKEND, rank - 1, world - 1)
    version, seen = None, []
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        method, args = box[0]
        error = None
        try:
            if method == "update_weights":
                version = args[0]["version"]
                worker.model.calls.clear()
            getattr(worker, method)(*args)
            if method == "finish_weight_update":
                check_model(worker.model.weights, seed, version)
                check(sorted(worker.model.weights) == sorted(SHAPES), "names")
                seen.append(len(worker.model.calls))
        except Exception as e:  # noqa: BLE001 - reported to the trainer like an RPC error
            error = f"{type(e).__name__}: {e}"
        dist.gather_object(error, None, dst=0)
        if error:
            raise RuntimeError(error)
        if method == "shutdown_weight_transfer_engine":
            return impl, (seen, list(fake_vllm.RELOADS))


def verl_e2e(rank, world, seed, steps, keep_base, rebuild_group):
    """Ranks 0-1 are actor workers (rank 0 the master), 2-3 rollout workers;
    each step runs the CheckpointEngineManager's order (fake_verl) with the
    test's torch.distributed world standing in for Ray."""
    import asyncio

    import fake_verl

    impl = use_delta()
    fake_verl.install()
    import portable_zip.weights.verl as pzverl  # registers on import where verl.checkpoint_engine.base imports

    reg = fake_verl.CheckpointEngineRegistry
    check(reg.get("portable_zip") is pzverl.engine_class(), "registered on import")
    pzverl.register()  # again: no error
    actors, rollouts = 2, world - 2
    actor = rank < actors
    kw = {"bucket_size": 3000, "keep_base": keep_base, "compress": "always", "timeout": 30,
          "rebuild_group": rebuild_group}
    eng = reg.new("portable_zip", is_master=rank == 0, **kw) if actor else reg.new("portable_zip", **kw)
    out = []
    for step in range(steps):
        metas = [None] * world
        dist.all_gather_object(metas, eng.prepare())  # actors first: metadata[0] is actor rank 0
        actor_kw, rollout_kw = type(eng).build_topology(actors, rollouts, metas)
        check(all(len(v) == actors for v in actor_kw.values()) and all(len(v) == rollouts for v in rollout_kw.values()),
              "topology lists")
        mine, i = (actor_kw, rank) if actor else (rollout_kw, rank - actors)
        eng.init_process_group(**{k: v[i] for k, v in mine.items()})
        if actor:
            drained = []

            def gen():
                for n, t in model(seed, step).items():
                    drained.append(n)
                    yield n, t

            metrics = asyncio.run(eng.send_weights(gen(), global_steps=step))
            check(drained == list(SHAPES), f"actor {rank} drained {drained}")
            out.append(metrics.get("pz/delta_chunks", -1.0))
        else:
            weights = eng.receive_weights(global_steps=step)  # not awaited, as verl calls it

            async def consume():
                got = {}
                async for n, t in fake_verl.ensure_async_iterator(weights):
                    got[n] = t.clone()  # consumed before the next item, as verl's loaders do
                return got

            got = asyncio.run(consume())
            check_model(got, seed, step)
            check(sorted(got) == sorted(SHAPES), "names")
            out.append(sum(p["delta"] for p in eng.stats()[-3:]))
        eng.finalize()
        dist.barrier()
    return impl, out
