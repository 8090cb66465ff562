"""pz.Communicator: torch.distributed-style compressed communication."""
from __future__ import annotations

import concurrent.futures
import math
import numbers
import os
import threading
import time
import zlib
from collections import defaultdict
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .._dtypes import CODED, code_of
from ..codec import _overlap
from . import collectives as coll
from .collectives import ReduceOp
from . import wire
from .errors import MismatchError, PeerError, PeerTimeout
from .policy import TORCH_COSTS, Policy
from . import domains as dom
from . import fabric
from .transport import TorchDistTransport, movable, new_group_bounded
from .wire import CHECK_PROTO, CTRL_WORDS, SPEC_PROTO

_OPS = ["send", "recv", "broadcast", "all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
_MODES = ["auto", "always", "never"]
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
        """Block until the op is done (re-raising its error). The op itself is
        bounded by its Communicator's timeout; timeout (seconds) only bounds
        this wait: past it, PeerTimeout says the op is still running."""
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
        if timeout is not None and timeout > threading.TIMEOUT_MAX:
            timeout = None  # inf: the op's own timeout bounds it
        if self._flush is not None:
            self._flush()
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():  # done as the wait expired: its own outcome (PeerTimeout is a TimeoutError)
                self._future.result()
                return True
            raise PeerTimeout(f"the op did not finish within wait(timeout={timeout:g}); it is still running, "
                              "wait() again") from None
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
    transport: "torch" (torch.distributed p2p: NCCL, RCCL or gloo), "fabric"
        (the libfabric engine between every pair, or between domains), or "auto"
        (torch when every rank has the same device kind, else domains by kind).
    domains: None (detected), "host", or a list of rank lists: native inside a
        domain, fabric between (docs/TRANSPORT.md).
    device: the tensors this rank moves ("cuda", "cpu"); default: the group
        backend's (nccl: the current GPU, else the CPU).
    timeout: seconds before a silent peer raises PeerTimeout (PZ_TIMEOUT, default 300).
    link_gbps, latency_us, codec_gbps, margin: policy overrides (also PZ_* env vars).
    """

    def __init__(self, group=None, compress: str = "auto", transport: str = "auto", timeout: Optional[float] = None,
                 link_gbps: Optional[float] = None, latency_us: Optional[float] = None,
                 codec_gbps: Optional[float] = None, margin: Optional[float] = None, domains=None,
                 device=None):
        if not dist.is_initialized():
            raise RuntimeError("pz.Communicator needs torch.distributed.init_process_group() first")
        if compress not in _MODES:
            raise ValueError(f"compress must be 'auto', 'always' or 'never', got {compress!r}")
        if timeout is None:
            timeout = os.environ.get("PZ_TIMEOUT", 300)
        try:
            self.timeout = float(timeout)
        except (TypeError, ValueError):
            raise TypeError(f"timeout must be a number of seconds, got {timeout!r}") from None
        if not 0 < self.timeout < math.inf:
            raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
        if transport not in ("auto", "torch", "fabric"):
            raise ValueError(f"transport must be 'auto', 'torch' (torch.distributed) or 'fabric' (libfabric), "
                             f"got {transport!r}")
        if transport == "fabric" and fabric.available():
            raise RuntimeError(f"transport='fabric' is unavailable: {fabric.available()}")
        # A private group over the same ranks: ops queued on our worker never
        # share tags or sequence numbers with the caller's own ops on theirs.
        self.parent_group = group if group is not None else dist.group.WORLD
        self.group = _private_group(self.parent_group, self.timeout)
        self.compress = compress
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.device = _device_of(device, self.group)
        self._cuda = self.device.type == "cuda"
        self._open_transport(transport, domains)
        self.policy = Policy(link_gbps, latency_us, codec_gbps, margin)
        self.policy.costs = getattr(self.tp, "costs", TORCH_COSTS)  # the fabric engine's sized exchange: fewer rounds
        if self._mixed:
            self.policy.cross_pairs = tuple((i, j) for i in range(self.world) for j in range(i)
                                            if self._domain_of[i] != self._domain_of[j])
        self.policy = Policy(link_gbps, latency_us, codec_gbps, margin)
        self.policy.costs = getattr(self.tp, "costs", TORCH_COSTS)  # the fabric engine's sized exchange: fewer rounds
        if self._mixed:
            self.policy.cross_pairs = tuple((i, j) for i in range(self.world) for j in range(i)
                                            if self._domain_of[i] != self._domain_of[j])
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
        self._stream_native = self._torch and self.tp.backend == "nccl" and os.environ.get("PZ_SYNC_NATIVE", "0") != "1"
        self._closed = False
        self._check_plans = False
        self.tp.connect(self.timeout)  # collective: every rank constructs its Communicator
        self._handshake()

    def _open_transport(self, transport: str, domains) -> None:
        """One domain: torch.distributed, as ever. Several (mixed vendors, or
        transport='fabric'): the fabric engine between them, each domain's
        native backend inside."""
        facts = dom.rank_facts(self.group, self.device, self.timeout, domains)
        dom.check_facts(facts)
        self._all_gpu = all(f["kind"] != "cpu" for f in facts)
        self.domains = dom.resolve(domains, facts, transport)
        self._domain_of = {r: i for i, d in enumerate(self.domains) for r in d}
        mine = self.domains[self._domain_of[self.rank]]
        self._torch = len(self.domains) == 1
        if self._torch and transport == "fabric" and self.world > 1:
            self._torch = False  # domains=[every rank]: still asked for the fabric; all of it rides there
            self.domains = [[r] for r in range(self.world)]
            self._domain_of = {r: r for r in range(self.world)}
            mine = [self.rank]
        if self._torch:
            if len({f["kind"] for f in facts}) > 1:
                raise ValueError("ranks hold different device kinds (" + ", ".join(
                    f"rank {j} {f['kind']}" for j, f in enumerate(facts)) + "): torch.distributed cannot connect "
                    "them; use transport='auto' or 'fabric'")
            self.tp = TorchDistTransport(self.group)
            if self.device != self.tp.device:
                raise ValueError(f"device={self.device} but group backend '{self.tp.backend}' moves "
                                 f"{self.tp.device.type} tensors")
            backend = self.tp.backend
            if backend == "nccl":
                lib = "RCCL" if torch.version.hip else "NCCL"
                why = f"group backend 'nccl' on {'ROCm' if torch.version.hip else 'CUDA'} torch: {lib}, GPU tensors"
            else:
                lib, why = backend, f"group backend '{backend}': CPU tensors"
            self.backend = f"{lib} via {self.tp.name} ({why})"
            self._hier = self._mixed = False
            return
        if transport == "torch":
            raise ValueError(f"domains {self.domains} need the fabric transport between them; use transport='auto' "
                             "or 'fabric'")
        if fabric.available():
            raise RuntimeError(f"ranks form {len(self.domains)} domains {self.domains} (device kinds: " +
                               ", ".join(sorted({f['kind'] for f in facts})) + "), which only the fabric transport "
                               f"connects, and it is unavailable: {fabric.available()}")
        same_host = len({f["host"] for f in facts}) == 1
        fab = fabric.FabricTransport(self.group, self.device, self.timeout, same_host)
        # Mixed: some domain holds several ranks, so pairs differ (native inside, fabric between).
        self._mixed = any(len(d) > 1 for d in self.domains)
        if not self._mixed:
            self.tp = fab
        else:
            # Every rank makes exactly one domain group, singletons too: torch
            # names groups by how many this process holds, so counts must stay
            # equal on every rank for later groups to match up.
            parent = dist.get_process_group_ranks(self.group)
            grp = dom.domain_group(parent, mine, facts[self.rank]["kind"], self.timeout)
            local = TorchDistTransport(grp) if len(mine) > 1 else None
            self.tp = dom.RoutedTransport(local, mine, fab)
        # Hierarchical reductions need equal domains (one shard per local rank).
        self._hier = len({len(d) for d in self.domains}) == 1 and len(self.domains[0]) > 1
        self.backend = (f"{self.tp.name} ({fab.info['rails']} rails, {fab.info['chunk']}-byte chunks; "
                        f"domains {self.domains})")

    def _observe(self, streams) -> None:
        """Learn the ratio only where every rank sees every stream once: in a
        mixed cluster each rank sees only its cross-domain peers' streams."""
        if not self._mixed:
            self.policy.observe(streams)

    def _cross(self, peer: int) -> bool:
        return self._domain_of[peer] != self._domain_of[self.rank]

    def _coded(self, plan: str, dtype: torch.dtype, nbytes: int):
        """What collectives take as `coded`: a bool, or per peer in mixed
        clusters: only hops between domains, and under auto only pairs whose
        two codecs beat the link (a CPU rank's may not)."""
        if plan != "compressed" or not self._mixed:
            return plan == "compressed"
        if self.compress == "always":
            return self._cross
        per = max(nbytes // self.world, 1)
        return lambda p: self._cross(p) and self.policy.pair_pays(dtype, per, self.rank, p)

    def _handshake(self) -> None:
        """Agree at construction on everything later plans read besides the
        op's own arguments: compress mode, wire/format version, the
        PZ_CHECK_PLANS mode, and (auto) the calibration constants."""
        want_check = os.environ.get("PZ_CHECK_PLANS", "0") not in ("", "0")
        cached = self.policy.cached_digest(self.tp, self.parent_group) if self.compress == "auto" else 0
        spec = [SPEC_PROTO, wire.WIRE_VERSION, -1, _MODES.index(self.compress), int(want_check), cached,
                wire.piece_override()]
        rows = self._swap_all(spec + [0] * (CTRL_WORDS - len(spec)))
        self._screen(rows, "the constructor")
        if any(row[3] != rows[0][3] for row in rows):
            modes = ", ".join(f"rank {j} {_MODES[row[3]] if 0 <= row[3] < 3 else row[3]!r}" for j, row in enumerate(rows))
            raise MismatchError(f"compress= differs between ranks: {modes}; every rank must use the same mode")
        if any(row[6] != rows[0][6] for row in rows):
            raise MismatchError("PZ_PIECE_BYTES differs between ranks: " +
                                ", ".join(f"rank {j} {row[6] or 'unset'}" for j, row in enumerate(rows)))
        self._check_plans = any(row[4] for row in rows)
        if self.compress == "auto":  # a cache is reused only where every rank holds the same one
            self.policy.calibrate(self.tp, self.group, self.timeout, self.parent_group,
                                  cached=rows[0][5] != 0 and all(row[5] == rows[0][5] for row in rows),
                                  swap=self._swap_floats, torch_native=self._torch, all_gpu=self._all_gpu)

    def _swap_all(self, spec: Sequence, dtype: torch.dtype = torch.int64) -> list:
        """Every rank's message of len(spec) values (this rank's is spec), bounded by the timeout."""
        if self.world == 1:
            return [list(spec)]
        mine = torch.tensor(spec, dtype=dtype, device=self.device)
        peers = [j for j in range(self.world) if j != self.rank]
        got = {j: torch.empty_like(mine) for j in peers}
        self.tp.wait(self.tp.post([("send", mine, j) for j in peers] + [("recv", got[j], j) for j in peers]),
                     self.timeout)
        return [list(spec) if j == self.rank else got[j].tolist() for j in range(self.world)]

    def _swap_floats(self, values: Sequence[float]) -> list:
        return self._swap_all(values, torch.float64)

    def _screen(self, rows: list, where: str) -> None:
        """Reject rows that are not spec messages of this wire version, alike on every rank."""
        problems = []
        for j, row in enumerate(rows):
            if row[0] in (wire.PROTO, CHECK_PROTO):
                problems.append(f"rank {j} is in a send/recv exchange while rank {self.rank} is in {where}")
            elif row[0] != SPEC_PROTO:
                raise PeerError(f"rank {j} sent a garbled control message")
            elif row[1] != wire.WIRE_VERSION:
                problems.append(f"version mismatch: rank {j} speaks wire/format version {row[1] & 0xFF}/{row[1] >> 8}, "
                                f"rank {self.rank} {wire.WIRE_VERSION & 0xFF}/{wire.WIRE_VERSION >> 8}")
        if problems:
            raise MismatchError("; ".join(problems))

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
        self._open()
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
            return "native" if self.compress == "auto" and self._torch else "raw"
        if self.compress == "always":
            return "compressed"
        if self._mixed:  # compressed when some cross-domain pair gains; _coded picks the pairs
            return "compressed" if self.policy.any_pair_pays(dtype, max(nbytes // self.world, 1)) else "raw"
        plan = self.policy.choose(op, dtype, nbytes, self.world)
        # Native means torch.distributed's own op: only a one-domain group has it.
        return plan if self._torch or plan != "native" else "raw"

    def _open(self) -> None:
        if self._closed:
            raise RuntimeError("this Communicator is closed")

    def _check(self, t: torch.Tensor, what: str, reduce: bool = False) -> None:
        self._open()
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        if t.is_conj() or t.is_neg():
            raise ValueError(f"{what} is a lazy {'conj' if t.is_conj() else 'neg'} view whose memory does not hold "
                             "its values: call .resolve_conj() / .resolve_neg() first")
        if t.is_cuda != self._cuda:
            raise ValueError(f"{what} is on {t.device} but this communicator moves {self.device.type} tensors "
                             f"({self.backend})")
        if reduce and t.dtype in _FP8:
            raise TypeError(f"reduction ops are not defined for {t.dtype}: fp8 tensors can be moved "
                            "(send, broadcast, all_gather, all_to_all) but not reduced")
        if reduce and t.dtype not in _REDUCIBLE:
            raise TypeError(f"reduction ops support bfloat16, float16, float32 and float64 tensors, not {t.dtype}")

    _PLAN_IDS = {"native": 0, "raw": 1, "compressed": 2, "decided from the split matrix": 3}

    def _agree(self, op: str, plan: str, dtype: torch.dtype, fields: Sequence[int], splits=None):
        """Swap a spec with every peer (bounded by the timeout) so a mismatched
        dtype, size, version, plan or policy state raises the same
        MismatchError on every rank. fields (up to 4 ints) must agree on all
        ranks; splits (all_to_all: input and output split sizes) are checked as
        a matrix in a second round, so every rank sees every pair's mismatch."""
        fp = self.policy.fingerprint(dtype) & 0x7FFFFFFF
        spec = [SPEC_PROTO, wire.WIRE_VERSION, _OPS.index(op), self._PLAN_IDS[plan], fp, code_of(dtype), *fields]
        # The last word: PZ_PIECE_BYTES, which sets the piece sizes collectives derive on both sides.
        rows = self._swap_all(spec + [0] * (CTRL_WORDS - 1 - len(spec)) + [wire.piece_override()])
        self._screen(rows, op)
        problems = []
        names = {v: k for k, v in self._PLAN_IDS.items()}
        for j, row in enumerate(rows):
            if row[2] != spec[2]:
                problems.append(f"rank {j} is in {_OPS[row[2]] if 0 <= row[2] < len(_OPS) else 'the constructor'} "
                                f"while rank {self.rank} is in {op}")
            elif row[3] != rows[0][3]:
                problems.append(f"{op}: rank {j} runs the {names.get(row[3], row[3])} plan but rank 0 the "
                                f"{names.get(rows[0][3], rows[0][3])} plan (the plan rule diverged)")
            elif any(row[k] != rows[0][k] for k in range(5, 6 + len(fields))):
                problems += [f"{op}: rank {j} has {self._field(k - 5, row)} but rank 0 has {self._field(k - 5, rows[0])}"
                             for k in range(5, 6 + len(fields)) if row[k] != rows[0][k]]
            elif row[-1] != rows[0][-1]:
                problems.append(f"{op}: PZ_PIECE_BYTES differs: rank {j} {row[-1] or 'unset'}, rank 0 "
                                f"{rows[0][-1] or 'unset'}")
            elif row[4] != rows[0][4]:
                problems.append(f"{op}: rank {j} decides from different policy state than rank 0 "
                                f"(fingerprint {row[4]:#x} vs {rows[0][4]:#x})")
        if problems:
            raise MismatchError("; ".join(dict.fromkeys(problems)))
        if splits is not None:
            mat = self._swap_all([*splits[0], *splits[1]])
            w = self.world
            bad = [f"rank {i} sends {mat[i][j]} rows to rank {j}, which expects {mat[j][w + i]}"
                   for i in range(w) for j in range(w) if mat[i][j] != mat[j][w + i]]
            if bad:
                raise MismatchError("all_to_all split mismatch: " + "; ".join(bad))
            return mat
        return None

    @staticmethod
    def _field(k, row):
        from .._dtypes import CODE_TO_DTYPE

        v = row[5 + k]
        if k == 0:
            return f"dtype {str(CODE_TO_DTYPE.get(v, v)).replace('torch.', '')}"
        return f"{['numel', 'arg', 'arg', 'arg'][k - 1]} {v}"

    def _bytes(self, *ts: torch.Tensor) -> list:
        """What the native op moves: each tensor, or its uint8 view where the backend lacks the dtype."""
        return [movable(t, self.tp.backend) for t in ts]

    def _idle_native(self, op: str, t: torch.Tensor) -> bool:
        """Nothing queued and op on t runs native: the caller can make the one
        torch.distributed call on this thread and skip the op's machinery
        (never under PZ_CHECK_PLANS, which checks every op's spec)."""
        return (not self._pending and not self._outstanding and not self._check_plans
                and self._plan(op, t.dtype, t.nbytes) == "native")

    def _native_now(self, op: str, t: torch.Tensor, async_op: bool) -> bool:
        """A blocking collective that runs native with no host wait (NCCL):
        auto then adds only this check to what torch costs."""
        return not async_op and self._stream_native and self._idle_native(op, t)

    def _await_native(self, works, detached: bool = False) -> None:
        """Finish native transfers the way torch.distributed does: on NCCL,
        order the current stream after them and return (no host wait, so auto
        costs what torch costs); on gloo, wait bounded by the timeout
        (detached: on a helper thread, for works whose wait ignores it)."""
        works = works if isinstance(works, list) else [works]
        if self._stream_native:
            for w in works:
                w.wait()
        elif detached and self.tp.backend == "gloo":
            self.tp.wait_detached(works, self.timeout)
        else:
            self.tp.wait(works, self.timeout)

    def _native_done(self, op: str, t0: float, works, sent: int, calls: int = 1, detached: bool = False) -> None:
        self._await_native(works, detached)
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
        torch.distributed transfer, nothing else (both sides decide alike:
        the pair's plan is a function of the pair's tensors, here just t;
        on NCCL it is posted as a batch like any other, see transport.post)."""
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

    def _pair_plan(self, ts: list, peer: int) -> str:
        """The plan of one peer pair in a group, from what both sides hold
        alike: the pair's tensors in both directions (one side's sends are the
        other's receives), as bytes per dtype; in a mixed cluster, from the
        pair's own codecs too."""
        total = defaultdict(int)
        for t in ts:
            total[t.dtype] += t.nbytes
        if self._mixed:
            if not self._cross(peer) or self.compress == "never":
                return "raw"
            pays = self.compress == "always" or any(self.policy.pair_pays(dtype, n, self.rank, peer)
                                                     for dtype, n in total.items())
            return "compressed" if pays else "raw"
        plans = {self._plan("send", dtype, n) for dtype, n in total.items()} or {"native"}
        if plans == {"native"}:
            return "native"
        return "compressed" if "compressed" in plans else "raw"

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
                peers = sorted(set(sends) | set(recvs))
                pairs = {p: self._pair_plan(sends.get(p, []) + recvs.get(p, []), p) for p in peers}
                if self._check_plans:
                    self._check_pairs(pairs, sends, recvs)
                if set(pairs.values()) == {"native"}:
                    # Fast path: straight to torch.distributed, no extra round trip.
                    ops = [("send", t, p) for p, ts in sends.items() for t in ts] + \
                          [("recv", t, p) for p, ts in recvs.items() for t in ts]
                    self._await_native(self.tp.post(ops))
                    raw = sum(t.nbytes for ts in sends.values() for t in ts)
                    res, plan = coll.Result(raw, raw), "native"
                else:
                    # Native pairs ride in the same exchange, uncompressed and
                    # with no control round (both sides know they are native).
                    res = self.tp.exchange(sends, recvs, {
                        p: wire.Plan(coded=pl == "compressed", agreed=pl == "native") for p, pl in pairs.items()},
                        self.timeout)
                    plan = "compressed" if "compressed" in pairs.values() else "raw"
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

    def _check_pairs(self, pairs: dict, sends: dict, recvs: dict) -> None:
        """PZ_CHECK_PLANS: swap each pair's plan and a digest of its specs
        (with the first spec each way) both ways; both sides compare the same
        two messages and word the problem alike, so both raise alike."""
        def specs(ts):
            return [(code_of(t.dtype), t.numel()) for t in ts]

        def digest(ts):
            return zlib.crc32(repr(specs(ts)).encode()) & 0x7FFFFFFF

        msgs = {}
        for p, pl in pairs.items():
            ss, rs = sends.get(p, []), recvs.get(p, [])
            first_s = specs(ss[:1])[0] if ss else (0, 0)
            first_r = specs(rs[:1])[0] if rs else (0, 0)
            msgs[p] = [CHECK_PROTO, wire.WIRE_VERSION, self._PLAN_IDS[pl], len(ss), len(rs), digest(ss), digest(rs),
                       *first_s, *first_r, 0]
        out = {p: torch.tensor(m, dtype=torch.int64, device=self.device) for p, m in msgs.items()}
        got = {p: torch.empty_like(t) for p, t in out.items()}
        self.tp.wait(self.tp.post([("send", t, p) for p, t in out.items()] + [("recv", t, p) for p, t in got.items()]),
                     self.timeout)
        names = {v: k for k, v in self._PLAN_IDS.items()}
        problems = []
        for p in sorted(pairs):
            mine, theirs = msgs[p], got[p].tolist()
            lo, hi = sorted((self.rank, p))
            a, b = (mine, theirs) if self.rank == lo else (theirs, mine)  # both sides word it alike
            if theirs[0] != CHECK_PROTO:
                problems.append(f"ranks {lo} and {hi} are not both in a send/recv group")
                continue
            if a[1] != b[1]:
                problems.append(f"version mismatch: rank {lo} speaks wire/format version {a[1] & 0xFF}/{a[1] >> 8}, "
                                f"rank {hi} {b[1] & 0xFF}/{b[1] >> 8}")
                continue
            for snd, rcv, x, y in ((lo, hi, a, b), (hi, lo, b, a)):  # x sends to y
                if x[3] != y[4]:
                    problems.append(wire._count_problem(snd, rcv, x[3], y[4], [x[7:9]], [y[9:11]]))
                elif x[5] != y[6]:
                    problems.append(f"size/dtype mismatch: rank {snd} sends {wire._describe(*x[7:9])}..., rank {rcv} "
                                    f"expects {wire._describe(*y[9:11])}..." if x[3] > 1 else
                                    f"size/dtype mismatch: rank {snd} sends {wire._describe(*x[7:9])}, rank {rcv} "
                                    f"expects {wire._describe(*y[9:11])}")
            if a[2] != b[2] and not problems:
                problems.append(f"send/recv between ranks {lo} and {hi}: rank {lo} runs the {names.get(a[2])} plan, "
                                f"rank {hi} the {names.get(b[2])} plan (the plan rule diverged)")
        if problems:
            raise MismatchError("; ".join(problems))

    def _peer(self, r: int) -> None:
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= r < self.world or r == self.rank:
            raise ValueError(f"peer rank {r} is not another rank of this group (size {self.world}, "
                             f"this rank {self.rank})")

    # --- collectives ------------------------------------------------------------
    # A collective's plan is a function of (op, dtype, numel) and the agreed
    # policy state, so every rank of a correct program picks the same one.
    # Non-native plans then swap a spec (_agree) that carries the plan and the
    # policy fingerprint; native plans skip it unless PZ_CHECK_PLANS is on.
    def broadcast(self, t: torch.Tensor, src: int, async_op: bool = False):
        self._check(t, "broadcast tensor")
        self._rank_arg(src, "src")

        def native():
            return dist.broadcast(*self._bytes(t), self.tp.global_rank(src), group=self.group, async_op=True)

        sent = t.nbytes * (self.world - 1) if self.rank == src else 0
        if self._native_now("broadcast", t, async_op):
            return self._native_done("broadcast", time.perf_counter(), native(), sent)

        def run():
            t0, plan = time.perf_counter(), self._plan("broadcast", t.dtype, t.nbytes)
            if self._check_plans or plan != "native":
                self._agree("broadcast", plan, t.dtype, [t.numel(), src])
            if plan == "native":
                return self._native_done("broadcast", t0, native(), sent)
            res = coll.broadcast(self.tp, t, src, self._coded(plan, t.dtype, t.nbytes), self.timeout)
            # Every rank sees each piece's stream once: the source its own, the others the received ones.
            self._observe(res.streams)
            self._record("broadcast", plan, t0, res.raw_bytes, res.wire_bytes)
        return self._submit(run, async_op)

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        self._check(out, "all_gather output")
        self._check(inp, "all_gather input")
        if out.dtype != inp.dtype or out.numel() != self.world * inp.numel():
            raise ValueError(f"all_gather output must be {inp.dtype} with world_size * input numel = "
                             f"{self.world * inp.numel()} elements, got {out.dtype} with {out.numel()}")
        own = out.reshape(-1)[self.rank * inp.numel():(self.rank + 1) * inp.numel()]
        if _overlap(out, inp) and not (inp.data_ptr() == own.data_ptr() or inp.numel() == 0):
            inp = inp.clone()  # overlapping out anywhere but its own slot: receives would overwrite it

        def native():
            return coll.all_gather_native(*self._bytes(out, inp), group=self.group, async_op=True)

        sent = inp.nbytes * (self.world - 1)
        if self._native_now("all_gather", inp, async_op):
            return self._native_done("all_gather", time.perf_counter(), native(), sent)

        def run():
            t0, plan = time.perf_counter(), self._plan("all_gather", inp.dtype, inp.nbytes)
            if self._check_plans or plan != "native":
                self._agree("all_gather", plan, inp.dtype, [inp.numel()])
            if plan == "native":
                return self._native_done("all_gather", t0, native(), sent)
            res = coll.all_gather(self.tp, out, inp, self._coded(plan, inp.dtype, inp.nbytes), self.timeout)
            self._observe(res.streams)  # every rank's stream, once each, on every rank
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
        if _overlap(out, inp):
            inp = inp.clone()

        def run():
            t0, plan = time.perf_counter(), self._plan("reduce_scatter", inp.dtype, inp.nbytes)
            if self._check_plans or plan != "native":
                self._agree("reduce_scatter", plan, inp.dtype, [inp.numel(), list(ReduceOp).index(op)])
            if plan == "native":
                w = coll.reduce_scatter_native(out, inp, op=op.native(), group=self.group, async_op=True)
                # gloo's reduce_scatter ignores wait(timeout): wait on a helper thread.
                return self._native_done("reduce_scatter", t0, w, out.nbytes * (self.world - 1), detached=True)
            res = coll.reduce_scatter(self.tp, out, inp, op, self._coded(plan, inp.dtype, inp.nbytes), self.timeout)
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
            if self._check_plans or plan != "native":
                self._agree("all_reduce", plan, t.dtype, [t.numel(), list(ReduceOp).index(op)])
            if plan == "native":
                return self._native_done("all_reduce", t0, native(), sent)
            if self._hier:
                rs, ag = coll.hier_all_reduce(self.tp, t, op, self._coded(plan, t.dtype, t.nbytes), self.timeout,
                                              self.domains)
            else:
                rs, ag = coll.all_reduce(self.tp, t, op, self._coded(plan, t.dtype, t.nbytes), self.timeout)
            self._observe(ag.streams)  # the all-gather phase: every shard's stream on every rank
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
        row = math.prod(inp.shape[1:])
        if row != math.prod(out.shape[1:]):
            raise ValueError(f"all_to_all input rows have {row} elements but output rows "
                             f"{math.prod(out.shape[1:])}")
        if _overlap(out, inp):
            inp = inp.clone()  # in place: receives would overwrite rows not yet sent

        def run():
            t0 = time.perf_counter()
            # Uneven splits give each rank different bytes, so auto decides
            # from the agreed split matrix (its heaviest rank), after the swap
            # that every rank checks as a whole, so all raise alike.
            plan = "decided from the split matrix" if self.compress == "auto" else \
                self._plan("all_to_all", inp.dtype, inp.nbytes)
            mat = self._agree("all_to_all", plan, inp.dtype, [row], splits=(in_splits, out_splits))
            if self.compress == "auto":
                heaviest = max(sum(r[:self.world]) for r in mat) * row * inp.element_size()
                plan = self._plan("all_to_all", inp.dtype, heaviest)
            if plan == "native":
                w = dist.all_to_all_single(coll.row_bytes(out), coll.row_bytes(inp), out_splits, in_splits,
                                           group=self.group, async_op=True)
                sent = inp.nbytes - in_splits[self.rank] * (inp.nbytes // max(inp.shape[0], 1))
                return self._native_done("all_to_all", t0, w, sent)
            res = coll.all_to_all(self.tp, out, inp, out_splits, in_splits, self._coded(plan, inp.dtype, inp.nbytes),
                                  self.timeout)
            self._record("all_to_all", plan, t0, res.raw_bytes, res.wire_bytes)
        return self._submit(run, async_op)

    def _splits(self, splits, t, what):
        rows = t.shape[0]
        if splits is None:
            if rows % self.world:
                raise ValueError(f"all_to_all {what} has {rows} rows, not divisible by world size {self.world}; "
                                 f"pass {what}_split_sizes")
            return [rows // self.world] * self.world
        splits = list(splits)
        if any(isinstance(s, bool) or not isinstance(s, (numbers.Integral, torch.SymInt)) for s in splits):
            raise TypeError(f"all_to_all {what}_split_sizes must be integers, got {splits}")
        splits = [int(s) for s in splits]
        if len(splits) != self.world or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"all_to_all {what}_split_sizes {splits} must be {self.world} non-negative sizes "
                             f"summing to {rows} rows")
        return splits

    def _rank_arg(self, r, what: str) -> None:
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= r < self.world:
            raise ValueError(f"{what} {r!r} is not a rank of this group (size {self.world})")

    def close(self) -> None:
        """Finish queued ops and release the worker; later ops raise."""
        if self._closed:
            return
        try:
            self._flush()
            self._drain()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            if not self._torch:
                self.tp.close()  # the fabric engine: endpoints and its progress thread

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world={self.world}, compress={self.compress!r}, {self.backend})"



def _device_of(device, group) -> torch.device:
    """The tensors this rank moves: device=, else the group backend's (nccl: the current GPU)."""
    if device is not None:
        d = torch.device(device)
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        if d.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be a CUDA/ROCm GPU or the CPU, got {device!r}")
        return d
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _private_group(parent, timeout: float):
    """A new group of parent's ranks: ops queued on our worker never share
    tags or sequence numbers with the caller's own ops on theirs."""
    return new_group_bounded(dist.get_process_group_ranks(parent), dist.get_backend(parent), timeout, "a peer")
