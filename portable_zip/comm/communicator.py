"""pz.Communicator: torch.distributed-style compressed communication."""
from __future__ import annotations

import concurrent.futures
import math
import os
import time
from collections import defaultdict
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .._dtypes import code_of
from . import collectives as coll
from .collectives import ReduceOp
from .errors import MismatchError, PeerError
from .policy import CODED, Policy
from .transport import TorchDistTransport, movable
from .wire import PROTO, WIRE_VERSION

_OPS = ["send", "recv", "broadcast", "all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
# Sets: membership is on every op's path.
_REDUCIBLE = frozenset((torch.bfloat16, torch.float16, torch.float32, torch.float64))
_FP8 = frozenset(d for d in (torch.float8_e4m3fn, torch.float8_e5m2, getattr(torch, "float8_e4m3fnuz", None),
                             getattr(torch, "float8_e5m2fnuz", None)) if d is not None)
_CODED = frozenset(CODED)


class Work:
    """Handle of an async op: wait() blocks until it is done (and re-raises its error)."""

    def __init__(self, future: concurrent.futures.Future, flush=None):
        self._future = future
        self._flush = flush

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._flush is not None:
            self._flush()
        self._future.result(timeout)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def result(self):
        return self._future.result()


class Communicator:
    """Compressed collectives over an initialized torch.distributed group.

    Compressed plans, and every op under compress="always" or "never", first
    check dtype, size and format version with the peers, so a mismatch raises
    MismatchError on every side. Ops that compress="auto" sends raw go straight
    to torch.distributed with no extra round trip (the policy must never lose
    to raw); a mismatch there surfaces as torch.distributed's error, or as
    PeerTimeout, never as a hang.

    compress: "auto" (the cost model decides per op), "always", or "never".
    transport: "auto" or "torch" (torch.distributed p2p: NCCL, RCCL or gloo).
    timeout: seconds before a silent peer raises PeerTimeout (PZ_TIMEOUT, default 300).
    link_gbps, latency_us, codec_gbps, margin: policy overrides (also PZ_* env vars).
    """

    def __init__(self, group=None, compress: str = "auto", transport: str = "auto", timeout: Optional[float] = None,
                 link_gbps: Optional[float] = None, latency_us: Optional[float] = None,
                 codec_gbps: Optional[float] = None, margin: Optional[float] = None):
        if not dist.is_initialized():
            raise RuntimeError("pz.Communicator needs torch.distributed.init_process_group() first")
        if compress not in ("auto", "always", "never"):
            raise ValueError(f"compress must be 'auto', 'always' or 'never', got {compress!r}")
        if transport not in ("auto", "torch"):
            raise ValueError(f"transport {transport!r} is not available: this version has 'auto' and 'torch' "
                             "(torch.distributed); libfabric and uccl transports plug into the same seam")
        self.group = group if group is not None else dist.group.WORLD
        self.compress = compress
        self.timeout = float(timeout if timeout is not None else os.environ.get("PZ_TIMEOUT", 300))
        self.tp = TorchDistTransport(self.group)
        self.rank, self.world, self.device = self.tp.rank, self.tp.world, self.tp.device
        self._cuda = self.device.type == "cuda"
        backend = self.tp.backend
        if backend == "nccl":
            lib = "RCCL" if torch.version.hip else "NCCL"
            why = f"group backend 'nccl' on {'ROCm' if torch.version.hip else 'CUDA'} torch: {lib}, GPU tensors"
        else:
            lib, why = backend, f"group backend '{backend}': CPU tensors"
        self.backend = f"{lib} via {self.tp.name} ({why})"
        self.policy = Policy(link_gbps, latency_us, codec_gbps, margin)
        self._stats = {op: {"calls": 0, "raw_bytes": 0, "wire_bytes": 0, "time_s": 0.0,
                            "plans": defaultdict(int)} for op in _OPS}
        dev = self.device
        self._pending = []
        self._outstanding = []
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pz-comm",
            initializer=(lambda: torch.cuda.set_device(dev)) if dev.type == "cuda" else None)
        # Native plans on NCCL are stream-ordered like torch.distributed's own
        # calls; PZ_SYNC_NATIVE=1 makes them wait on the host, bounded by timeout.
        self._stream_native = backend == "nccl" and os.environ.get("PZ_SYNC_NATIVE", "0") != "1"
        self.tp.connect(self.timeout)  # collective: every rank constructs its Communicator
        if compress == "auto":
            self.policy.calibrate(self.tp, self.group)

    # --- plumbing -------------------------------------------------------------
    @property
    def stats(self) -> dict:
        return {op: {**s, "plans": dict(s["plans"])} for op, s in self._stats.items() if s["calls"]}

    def _on_stream(self, fn):
        """fn, to run on the worker under the caller's current CUDA stream."""
        stream = torch.cuda.current_stream() if self.device.type == "cuda" else None

        def run():
            if stream is None:
                return fn()
            with torch.cuda.stream(stream):
                return fn()
        return run

    def _submit(self, fn, async_op: bool):
        self._flush()  # pending isend/irecv go first, in posting order
        if not async_op:
            # Blocking: run on this thread (no thread hop) once earlier async ops are done.
            self._drain()
            fn()
            return None
        fut = self._pool.submit(self._on_stream(fn))
        self._outstanding.append(fut)
        return Work(fut)

    def _drain(self) -> None:
        """Wait for queued async ops (their errors stay with their Work handles)."""
        while self._outstanding:
            concurrent.futures.wait([self._outstanding.pop(0)])

    def _record(self, op, plan, t0, raw, wire, calls: int = 1):
        s = self._stats[op]
        s["calls"] += calls
        s["raw_bytes"] += int(raw)
        s["wire_bytes"] += int(wire)
        s["time_s"] += time.perf_counter() - t0
        s["plans"][plan] += calls

    def _plan(self, op: str, dtype: torch.dtype, nbytes: int) -> str:
        if self.compress == "never":
            return "raw"
        if dtype not in _CODED:
            return "native" if self.compress == "auto" else "raw"
        if self.compress == "always":
            return "compressed"
        return self.policy.choose(op, dtype, nbytes, self.world)

    def _check(self, t: torch.Tensor, what: str, reduce: bool = False) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        if t.is_cuda != self._cuda:
            raise ValueError(f"{what} is on {t.device} but this communicator moves {self.device.type} tensors "
                             f"({self.backend})")
        if reduce and t.dtype in _FP8:
            raise TypeError(f"reduction ops are not defined for {t.dtype}: fp8 tensors can be moved "
                            "(send, broadcast, all_gather, all_to_all) but not reduced")
        if reduce and t.dtype not in _REDUCIBLE:
            raise TypeError(f"reduction ops support bfloat16, float16, float32 and float64 tensors, not {t.dtype}")

    _PLAN_IDS = {"native": 0, "raw": 1, "compressed": 2}

    def _agree(self, op: str, plan: str, fields: Sequence[int], same: Sequence[int]) -> list:
        """Swap a spec with every peer (bounded by the timeout) so mismatched
        dtype, size or version raises the same MismatchError on every rank.
        same: indexes into fields that must agree on all ranks."""
        spec = [PROTO, WIRE_VERSION, _OPS.index(op), self._PLAN_IDS[plan], *fields]
        if self.world == 1:
            return [spec]
        mine = torch.tensor(spec, dtype=torch.int64, device=self.device)
        peers = [j for j in range(self.world) if j != self.rank]
        got = {j: torch.empty_like(mine) for j in peers}
        self.tp.wait(self.tp.post([("send", mine, j) for j in peers] + [("recv", got[j], j) for j in peers]),
                     self.timeout)
        rows = [spec if j == self.rank else got[j].tolist() for j in range(self.world)]
        problems = []
        for j, row in enumerate(rows):
            if row[0] != PROTO:
                raise PeerError(f"rank {j} sent a garbled control message")
            if row[1] != WIRE_VERSION:
                problems.append(f"version mismatch: rank {j} speaks wire/format version {row[1] & 0xFF}/{row[1] >> 8}, "
                                f"rank {self.rank} {WIRE_VERSION & 0xFF}/{WIRE_VERSION >> 8}")
            elif row[2] != spec[2]:
                problems.append(f"rank {j} is in {_OPS[row[2]]} while rank {self.rank} is in {op}")
            elif row[3] != rows[0][3]:
                names = {v: k for k, v in self._PLAN_IDS.items()}
                problems.append(f"{op}: rank {j} runs the {names.get(row[3], row[3])} plan but rank 0 the "
                                f"{names.get(rows[0][3], rows[0][3])} plan (compress= differs between ranks)")
            else:
                for k in same:
                    if row[4 + k] != rows[0][4 + k]:
                        problems.append(f"{op}: rank {j} has {self._field(op, k, row)} but rank 0 has "
                                        f"{self._field(op, k, rows[0])}")
        if problems:
            raise MismatchError("; ".join(dict.fromkeys(problems)))
        return rows

    @staticmethod
    def _field(op, k, row):
        from .._dtypes import CODE_TO_DTYPE

        names = ["dtype", "numel", "arg"]
        v = row[4 + k]
        if k == 0:
            return f"dtype {str(CODE_TO_DTYPE.get(v, v)).replace('torch.', '')}"
        return f"{names[min(k, 2)]} {v}"

    def _bytes(self, *ts: torch.Tensor) -> list:
        """What the native op moves: each tensor, or its uint8 view where the backend lacks the dtype."""
        return [movable(t, self.tp.backend) for t in ts]

    def _idle_native(self, op: str, t: torch.Tensor) -> bool:
        """Nothing queued and op on t runs native: the caller can make the one
        torch.distributed call on this thread and skip the op's machinery."""
        return not self._pending and not self._outstanding and self._plan(op, t.dtype, t.nbytes) == "native"

    def _native_now(self, op: str, t: torch.Tensor, async_op: bool) -> bool:
        """A blocking collective that runs native with no host wait (NCCL):
        auto then adds only this check to what torch costs."""
        return not async_op and self._stream_native and self._idle_native(op, t)

    def _await_native(self, works) -> None:
        """Finish native transfers the way torch.distributed does: on NCCL,
        order the current stream after them and return (no host wait, so auto
        costs what torch costs); on gloo, wait bounded by the timeout."""
        works = works if isinstance(works, list) else [works]
        if self._stream_native:
            for w in works:
                w.wait()
        else:
            self.tp.wait(works, self.timeout)

    def _native_done(self, op: str, t0: float, works, sent: int, calls: int = 1) -> None:
        self._await_native(works)
        self._record(op, "native", t0, sent, sent, calls)

    # --- point to point -------------------------------------------------------
    # isend/irecv are grouped, like torch.distributed.batch_isend_irecv (and
    # NCCL group semantics): ops posted before a wait() run as one exchange, so
    # a ring of isend + irecv cannot deadlock, and a batch of tensors (a state
    # dict, KV blocks) costs the round trips of one transfer. Peers must post
    # matching groups.
    def send(self, t: torch.Tensor, dst: int) -> None:
        self._check(t, "send tensor")
        self._peer(dst)
        if not self._lone_native("send", t, dst):
            self._post_p2p("send", t, dst)
            self._flush(inline=True)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self._check(t, "recv tensor")
        self._peer(src)
        if not self._lone_native("recv", t, src):
            self._post_p2p("recv", t, src)
            self._flush(inline=True)

    def _lone_native(self, kind: str, t: torch.Tensor, peer: int) -> bool:
        """A blocking send/recv with nothing queued whose plan is native: one
        torch.distributed transfer, nothing else (both sides decide alike)."""
        if not self._idle_native("send", t):
            return False
        self._native_done(kind, time.perf_counter(), self.tp.post([(kind, t, peer)]), t.nbytes if kind == "send" else 0)
        return True

    def isend(self, t: torch.Tensor, dst: int) -> Work:
        self._check(t, "send tensor")
        self._peer(dst)
        return self._post_p2p("send", t, dst)

    def irecv(self, t: torch.Tensor, src: int) -> Work:
        self._check(t, "recv tensor")
        self._peer(src)
        return self._post_p2p("recv", t, src)

    def _post_p2p(self, kind, t, peer) -> Work:
        fut = concurrent.futures.Future()
        self._pending.append((kind, t, peer, fut))
        return Work(fut, self._flush)

    def _flush(self, inline: bool = False) -> None:
        """Run the pending isend/irecv group on the worker as one exchange:
        tensors to (from) the same peer travel in posting order, in waves."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        sends, recvs = {}, {}
        for kind, t, peer, _ in pending:
            (sends if kind == "send" else recvs).setdefault(peer, []).append(t)
        n_send = sum(len(v) for v in sends.values())

        def run():
            try:
                t0 = time.perf_counter()
                # Both sides of a pair see the same tensors (one's sends are the
                # other's receives), so they derive the same plan: per dtype, on
                # the group's total bytes, as the group moves as one transfer.
                total = defaultdict(int)
                for ts in [*sends.values(), *recvs.values()]:
                    for t in ts:
                        total[t.dtype] += t.nbytes
                plans = {self._plan("send", dtype, n) for dtype, n in total.items()}
                if plans == {"native"}:
                    # Fast path: straight to torch.distributed, no extra round trip.
                    ops = [("send", t, p) for p, ts in sends.items() for t in ts] + \
                          [("recv", t, p) for p, ts in recvs.items() for t in ts]
                    self._await_native(self.tp.post(ops))
                    raw = sum(t.nbytes for ts in sends.values() for t in ts)
                    res, plan = coll.Result(raw, raw), "native"
                else:
                    coded = "compressed" in plans
                    res = coll.exchange(self.tp, sends, recvs, coded, self.timeout)
                    plan = "compressed" if coded else "raw"
                if sends:
                    self._record("send", plan, t0, res.raw_bytes, res.wire_bytes, calls=n_send)
                if recvs:
                    self._record("recv", plan, t0, 0, 0, calls=len(pending) - n_send)
            except BaseException as e:  # noqa: BLE001 - every op of the group fails alike
                for *_, fut in pending:
                    fut.set_exception(e)
                raise
            for *_, fut in pending:
                fut.set_result(None)

        if inline:
            self._drain()
            run()
        else:
            self._outstanding.append(self._pool.submit(self._on_stream(run)))

    def _peer(self, r: int) -> None:
        if not 0 <= r < self.world or r == self.rank:
            raise ValueError(f"peer rank {r} is not another rank of this group (size {self.world}, "
                             f"this rank {self.rank})")

    # --- collectives ------------------------------------------------------------
    def broadcast(self, t: torch.Tensor, src: int, async_op: bool = False):
        self._check(t, "broadcast tensor")
        if not 0 <= src < self.world:
            raise ValueError(f"src {src} is not a rank of this group (size {self.world})")
        def native():
            return dist.broadcast(*self._bytes(t), self.tp.global_rank(src), group=self.group, async_op=True)

        sent = t.nbytes * (self.world - 1) if self.rank == src else 0
        if self._native_now("broadcast", t, async_op):
            return self._native_done("broadcast", time.perf_counter(), native(), sent)

        def run():
            t0, plan = time.perf_counter(), self._plan("broadcast", t.dtype, t.nbytes)
            if plan == "native":
                return self._native_done("broadcast", t0, native(), sent)
            self._agree("broadcast", plan, [code_of(t.dtype), t.numel(), src], same=[0, 1, 2])
            res = coll.broadcast(self.tp, t, src, plan == "compressed", self.timeout)
            self.policy.observe(res.streams if self.rank != src else res.streams[:1])
            self._record("broadcast", plan, t0, res.raw_bytes, res.wire_bytes)
        return self._submit(run, async_op)

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        self._check(out, "all_gather output")
        self._check(inp, "all_gather input")
        if out.dtype != inp.dtype or out.numel() != self.world * inp.numel():
            raise ValueError(f"all_gather output must be {inp.dtype} with world_size * input numel = "
                             f"{self.world * inp.numel()} elements, got {out.dtype} with {out.numel()}")
        def native():
            return coll.all_gather_native(*self._bytes(out, inp), group=self.group, async_op=True)

        sent = inp.nbytes * (self.world - 1)
        if self._native_now("all_gather", inp, async_op):
            return self._native_done("all_gather", time.perf_counter(), native(), sent)

        def run():
            t0, plan = time.perf_counter(), self._plan("all_gather", inp.dtype, inp.nbytes)
            if plan == "native":
                return self._native_done("all_gather", t0, native(), sent)
            self._agree("all_gather", plan, [code_of(inp.dtype), inp.numel()], same=[0, 1])
            res = coll.all_gather(self.tp, out, inp, plan == "compressed", self.timeout)
            self.policy.observe(res.streams)
            self._record("all_gather", plan, t0, res.raw_bytes, res.wire_bytes)
        return self._submit(run, async_op)

    all_gather_into_tensor = all_gather_single

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False):
        op = ReduceOp.of(op)
        self._check(out, "reduce_scatter output", reduce=True)
        self._check(inp, "reduce_scatter input", reduce=True)
        if out.dtype != inp.dtype or inp.numel() != self.world * out.numel():
            raise ValueError(f"reduce_scatter input must be {out.dtype} with world_size * output numel = "
                             f"{self.world * out.numel()} elements, got {inp.dtype} with {inp.numel()}")

        def run():
            t0, plan = time.perf_counter(), self._plan("reduce_scatter", inp.dtype, inp.nbytes)
            if plan == "native":
                w = coll.reduce_scatter_native(out, inp, op=op.native(), group=self.group, async_op=True)
                return self._native_done("reduce_scatter", t0, w, out.nbytes * (self.world - 1))
            self._agree("reduce_scatter", plan, [code_of(inp.dtype), inp.numel(), list(ReduceOp).index(op)],
                        same=[0, 1, 2])
            res = coll.reduce_scatter(self.tp, out, inp, op, plan == "compressed", self.timeout)
            self._record("reduce_scatter", plan, t0, res.raw_bytes, res.wire_bytes)
        return self._submit(run, async_op)

    reduce_scatter_tensor = reduce_scatter_single

    def all_reduce(self, t: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False):
        op = ReduceOp.of(op)
        self._check(t, "all_reduce tensor", reduce=True)

        def native():
            return dist.all_reduce(t, op=op.native(), group=self.group, async_op=True)

        sent = 2 * t.nbytes * (self.world - 1) // self.world
        if self._native_now("all_reduce", t, async_op):
            return self._native_done("all_reduce", time.perf_counter(), native(), sent)

        def run():
            t0, plan = time.perf_counter(), self._plan("all_reduce", t.dtype, t.nbytes)
            if plan == "native":
                return self._native_done("all_reduce", t0, native(), sent)
            self._agree("all_reduce", plan, [code_of(t.dtype), t.numel(), list(ReduceOp).index(op)], same=[0, 1, 2])
            rs, ag = coll.all_reduce(self.tp, t, op, plan == "compressed", self.timeout)
            self.policy.observe(ag.streams)
            self._record("all_reduce", plan, t0, rs.raw_bytes + ag.raw_bytes, rs.wire_bytes + ag.wire_bytes)
        return self._submit(run, async_op)

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, output_split_sizes: Optional[list] = None,
                          input_split_sizes: Optional[list] = None, async_op: bool = False):
        self._check(out, "all_to_all output")
        self._check(inp, "all_to_all input")
        if out.dtype != inp.dtype or out.dim() == 0 or inp.dim() == 0:
            raise ValueError("all_to_all input and output must share a dtype and have at least one dimension")
        in_splits = self._splits(input_split_sizes, inp, "input")
        out_splits = self._splits(output_split_sizes, out, "output")
        if math.prod(inp.shape[1:]) != math.prod(out.shape[1:]):
            raise ValueError(f"all_to_all input rows have {math.prod(inp.shape[1:])} elements but output rows "
                             f"{math.prod(out.shape[1:])}")

        def run():
            t0, plan = time.perf_counter(), self._plan("all_to_all", inp.dtype, inp.nbytes)
            if plan == "native":
                w = dist.all_to_all_single(coll.row_bytes(out), coll.row_bytes(inp), out_splits, in_splits,
                                           group=self.group, async_op=True)
                sent = inp.nbytes - in_splits[self.rank] * (inp.nbytes // max(inp.shape[0], 1))
                return self._native_done("all_to_all", t0, w, sent)
            # Rank j's input split for rank i must equal rank i's output split from j.
            rows = self._agree("all_to_all", plan, [code_of(inp.dtype), *in_splits, *out_splits], same=[0])
            for j, row in enumerate(rows):
                if row[5 + self.rank] != out_splits[j]:
                    raise MismatchError(f"all_to_all split mismatch: rank {j} sends {row[5 + self.rank]} rows to "
                                        f"rank {self.rank}, which expects {out_splits[j]}")
            res = coll.all_to_all(self.tp, out, inp, out_splits, in_splits, plan == "compressed", self.timeout)
            self._record("all_to_all", plan, t0, res.raw_bytes, res.wire_bytes)
        return self._submit(run, async_op)

    def _splits(self, splits, t, what):
        rows = t.shape[0]
        if splits is None:
            if rows % self.world:
                raise ValueError(f"all_to_all {what} has {rows} rows, not divisible by world size {self.world}; "
                                 f"pass {what}_split_sizes")
            return [rows // self.world] * self.world
        splits = [int(s) for s in splits]
        if len(splits) != self.world or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"all_to_all {what}_split_sizes {splits} must be {self.world} non-negative sizes "
                             f"summing to {rows} rows")
        return splits

    def close(self) -> None:
        self._flush()
        self._pool.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world={self.world}, compress={self.compress!r}, {self.backend})"
