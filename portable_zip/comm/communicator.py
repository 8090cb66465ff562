"""pz.Communicator: torch.distributed-style compressed communication. A
facade: it validates, asks for the plan (plans.py), agrees where the rule
says (agree.py) and submits the algorithm (collectives.py) or torch's own op
(native.py); construction is setup.py's, measuring calibration.py's."""
from __future__ import annotations

import concurrent.futures
import inspect
import math
import numbers
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import codec
from ..codec import overlaps
from .settings import Settings
from . import agree, calibration, native
from . import collectives as coll
from .args import check_args
from .collectives import REDUCIBLE, ReduceOp
from .deadline import Deadline
from .store import give_up
from .p2p import PointToPoint
from .observed import CodedSeen, LinkSeen
from .pieces import Call
from .plans import Plans
from .policy import Policy
from .setup import device_of, open_channel, open_transport, private_group, timeout_of
from .stats import Stats, merged
from .transports import fabric
from .transports.torch import movable, moved_as_is
from .work import Work, Worker, exclusive

# An async op called with torch_work=True (the pz backend's): where it runs
# torch's own collective (an idle native plan) it returns torch's Work itself,
# so the backend adds no thread hop to what torch costs.
_TORCH_WORK = object()
_FP8 = frozenset(d for d in (torch.float8_e4m3fn, torch.float8_e5m2, getattr(torch, "float8_e4m3fnuz", None),
                             getattr(torch, "float8_e5m2fnuz", None)) if d is not None)


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
    timeout: seconds an op may take before it raises PeerTimeout (PZ_TIMEOUT, default 300).
    max_sms: the most SMs any codec launch of this communicator uses, on every
        thread, async ops included (PZ_MAX_SMS; default all). A pz.sm_budget in
        force where an op is called caps it further.
    link_gbps, latency_us, codec_gbps, margin: policy overrides (also PZ_* env vars).
    Every PZ_* variable is read once, here (portable_zip/comm/settings.py).
    """

    def __init__(self, group=None, compress: str = "auto", transport: str = "auto", timeout: Optional[float] = None,
                 link_gbps: Optional[float] = None, latency_us: Optional[float] = None,
                 codec_gbps: Optional[float] = None, margin: Optional[float] = None, domains=None,
                 device=None, max_sms: Optional[int] = None):
        self.settings = s = Settings.from_env()
        max_sms = s.max_sms if max_sms is None else max_sms
        check_args(compress, transport, max_sms)
        self.timeout = timeout_of(timeout, s)
        if transport == "fabric" and fabric.unavailable():
            raise RuntimeError(f"transport='fabric' is unavailable: {fabric.unavailable()}")
        self.max_sms = None if max_sms is None else int(max_sms)
        link_gbps, latency_us, codec_gbps, margin = overrides(
            (_given(link_gbps, s.link_gbps), "link_gbps", link_gbps is None and "PZ_LINK_GBPS"),
            (_given(latency_us, s.link_latency_us), "latency_us", latency_us is None and "PZ_LINK_LATENCY_US"),
            (_given(codec_gbps, s.codec_gbps), "codec_gbps", codec_gbps is None and "PZ_CODEC_GBPS"),
            (_given(margin, s.policy_margin), "margin", margin is None and "PZ_POLICY_MARGIN"))
        self.parent_group = group if group is not None else dist.group.WORLD
        self.group = private_group(self.parent_group, self.timeout)
        self.compress = compress
        self.tp = self._worker = self._p2p = self._channel = None
        self._closed = False
        self._entry, self._inside = threading.Lock(), None  # one thread inside an op at a time (work.exclusive)
        self.on_enter: Optional[Callable[[], None]] = None  # called as an op enters (the pz backend's gate)
        self.on_stats: Optional[Callable[[], None]] = None  # called before the stats are read (the same)
        self._p2p_lock = threading.RLock()  # the pending isend/irecv group: posts and waits from any thread
        try:
            self._connect(s, transport, domains, device, (link_gbps, latency_us, codec_gbps, margin))
        except BaseException as e:
            give_up(self.group, f"{type(e).__name__}: {e}")  # ranks still constructing raise now, not at the timeout
            self._release()  # a failed construction keeps no threads, sockets or group
            raise

    def _connect(self, s: Settings, transport: str, domains, device, policy: tuple) -> None:
        """Construction past the private group: device, transport, worker, handshake, calibration."""
        link_gbps, latency_us, codec_gbps, margin = policy
        compress = self.compress
        self.rank, self.world = self.group.rank, self.group.size
        self.device = device_of(device, self.group)
        self._cuda = self.device.type == "cuda"
        lay = open_transport(self.group, self.device, transport, domains, s, self.timeout)
        self.tp, self.domains, self.backend = lay.tp, lay.domains, lay.backend
        # Point to point's own transports: their FIFOs carry nothing of the collectives'.
        self._channel = open_channel(self.parent_group, self.device, transport, domains, s, self.timeout)
        self._native, self._mixed, self._hier = lay.native, lay.mixed, lay.hier
        cross = tuple((i, j) for i in range(self.world) for j in range(i)
                      if lay.domain_of[i] != lay.domain_of[j]) if lay.mixed else ()
        self.policy = Policy(link_gbps, latency_us, codec_gbps, margin, costs=self.tp.costs, cross_pairs=cross)
        self._plans = Plans(compress, self.policy, self.rank, self.world, lay.domain_of, lay.native, lay.mixed)
        # Without torch collectives, auto's alternative to compressing is the raw pipeline: its runs teach the policy too.
        self._learns_raw = compress == "auto" and not lay.native
        self._stats = Stats()
        self._pending = []
        self._worker = Worker(self.device)
        # Native plans on NCCL are stream-ordered like torch.distributed's own
        # calls; PZ_SYNC_NATIVE=1 makes them wait on the host, bounded by timeout.
        self._stream_native = self._native and self.tp.backend == "nccl" and not s.sync_native
        self._as_is = moved_as_is(self.tp.backend)
        self._check_plans = False
        self.tp.connect(Deadline(self.timeout))  # collective: every rank constructs its Communicator
        for tp in dict.fromkeys(self._channel.tps):
            tp.connect(Deadline(self.timeout))
        self._seen, self._coded_seen = LinkSeen(), CodedSeen()
        self._p2p = PointToPoint(self._channel.tps, self._compresses, self.timeout, s.piece_bytes, self.max_sms,
                                 sent=self._sent if compress == "auto" and not lay.mixed else None)
        cached = calibration.cached_digest(self.policy, self.tp, self.parent_group, self._budget()) \
            if compress == "auto" else 0
        self._check_plans, reuse = agree.handshake(self.tp, compress, s.check_plans, cached, s.piece_bytes,
                                                   s.wave_bytes, Deadline(self.timeout))
        if compress == "auto":
            swap = lambda v: agree.swap_all(self.tp, v, Deadline(self.timeout), torch.float64)  # noqa: E731
            calibration.calibrate(self.policy, self.tp, self.group, self.timeout, self.parent_group, reuse,
                                  swap=swap, torch_native=self._native, all_gpu=lay.all_gpu, max_sms=self._budget(),
                                  one_way=not lay.native and not lay.mixed)
            # The fabric's host cost per compressed exchange is measured, not assumed (its constant came from
            # 32-64 MiB sends and overstates small exchanges' cost); a cached calibration holds it already.
            if self.tp.backend == "fabric" and not lay.mixed and self.world > 1 \
                    and self.policy.cal.host_exchange_s is None:
                calibration.measure_exchange(self.policy, self._exchange(), self.world, self.device, swap)
                self._stats = Stats()  # the measuring exchanges are not the caller's ops

    def _exchange(self):
        """A run of one compressed all_gather of calibration.EXCHANGE_BYTES of bf16 a rank; its tensors
        are built once, outside the runs that are timed."""
        n = calibration.EXCHANGE_BYTES // 2
        g = torch.Generator(device="cpu").manual_seed(self.rank)
        inp = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).to(self.device)
        out = torch.empty(self.world * n, dtype=torch.bfloat16, device=self.device)

        def run() -> None:
            mode, self._plans.mode = self._plans.mode, "always"
            try:
                self.all_gather_single(out, inp)
            finally:
                self._plans.mode = mode
        return run

    # --- plumbing -------------------------------------------------------------
    @property
    def stats(self) -> dict:
        if self.on_stats is not None:  # ops an adapter posted itself (the pz backend's gate) join first
            self.on_stats()
        own = self._stats.view()
        return merged([own, self._p2p.stats.view()]) if self._p2p is not None else own

    def _compresses(self, t: torch.Tensor, peer: int) -> bool:
        """A message's plan, the sender's alone (the receiver reads it from the frame): under auto,
        judged on the link to peer as this rank has seen it run (LinkSeen), once it ran slower than
        calibrated, on how its compressed messages of that size ran against their prediction
        (CodedSeen), and with more queued behind it as a stream whose codec work overlaps the wire."""
        slow = self._coded_seen.factor(peer, t.dtype, t.nbytes)  # both above 1 only under auto: no other mode observes
        link = self._seen.factor(peer)
        if self._plans.pair([t], peer) == "compressed":
            return slow == 1.0 or self.policy.send_pays(t.dtype, t.nbytes, link, self._p2p.backlog(peer), slow)
        return link > 1.0 and self.policy.send_pays(t.dtype, t.nbytes, link, self._p2p.backlog(peer), slow)

    def _sent(self, peer: int, t: torch.Tensor, coded: bool, seconds: float, took: float = 0.0) -> None:
        """A message peer has landed, its payloads having taken seconds to arrive there, the whole of it
        took seconds less any wait for the receiver (PointToPoint's report), under auto."""
        if self.policy.cal is None:
            return
        if coded:
            # Judged only on a link running as calibrated (within LinkSeen's snap): a slower one is
            # LinkSeen's to judge, and its factor lags the link, so the link's excess would count twice.
            if self._seen.factor(peer) == 1.0:
                p = self.policy
                self._coded_seen.coded(peer, t.dtype, t.nbytes, took,
                                       lambda: p.predict("send", t.dtype, t.nbytes, 2)[1] * p.slowdown)
            self._seen.coded(peer)
        else:
            self._coded_seen.raw(peer, t.dtype, t.nbytes)
            self._seen.raw(peer, t.nbytes, seconds, lambda: self.policy.predict("send", t.dtype, t.nbytes, 2)[0])

    def _budget(self) -> int:
        """The SM budget of a call's codec launches (0: all): max_sms, capped
        by the pz.sm_budget in force on the calling thread. Taken where the op
        is called (isend/irecv: posted) and carried to the worker, where no
        budget is set."""
        b, m = codec.max_sms_in_force(None), self.max_sms or 0
        return min(b, m) if b and m else b or m

    def _call(self, sms: int) -> Call:
        """One op's shared limits; its deadline starts when the op starts running."""
        return Call(Deadline(self.timeout), sms, self.settings)

    def _submit(self, fn, async_op: bool):
        self._open()
        self._flush()  # pending isend/irecv go first, in posting order
        sms = self._budget()
        if not async_op:
            # Blocking: run on this thread (no thread hop) once earlier async ops are done.
            self._worker.drain()
            fn(sms)
            return None
        return Work(self._worker.submit(lambda: fn(sms)))

    def drain(self) -> None:
        """Post the pending point-to-point group and run every queued op to
        its end (their errors stay with their Works): what a caller beside
        the queue (the pz backend, before torch's own op) waits for."""
        self._flush()
        self._worker.drain()

    def _record(self, op, plan, t0, raw, wire, calls: int = 1):
        self._stats.record(op, plan, t0, raw, wire, calls)

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
        if reduce and t.dtype not in REDUCIBLE:
            raise TypeError(f"reduction ops support bfloat16, float16, float32 and float64 tensors, not {t.dtype}")

    def _peer(self, r: int) -> None:
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= r < self.world or r == self.rank:
            raise ValueError(f"peer rank {r} is not another rank of this group (size {self.world}, "
                             f"this rank {self.rank})")

    def _rank_arg(self, r, what: str) -> None:
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= r < self.world:
            raise ValueError(f"{what} {r!r} is not a rank of this group (size {self.world})")

    def _agree(self, call: Call, op: str, plan: str, dtype: torch.dtype, fields, splits=None):
        """The spec swap; it carries each rank's latest observation to every
        rank's policy (policy.heard), so later plans are re-judged alike."""
        mat, notes = agree.collective(self.tp, op, plan, self.policy.fingerprint(dtype), dtype, fields,
                                      self.settings.piece_bytes, call.deadline, splits, self.policy.report())
        self.policy.heard(notes)
        return mat

    def _observe(self, streams) -> None:
        """Learn the ratio only where every rank sees every stream once: in a
        mixed cluster each rank sees only its cross-domain peers' streams."""
        if not self._mixed:
            self.policy.observe(streams)

    # --- native plans ---------------------------------------------------------
    def _bytes(self, *ts: torch.Tensor) -> list:
        """What the native op moves: each tensor, or its uint8 view where the backend lacks the dtype."""
        return [movable(t, self.tp.backend) for t in ts]

    def _idle_native(self, op: str, t: torch.Tensor) -> bool:
        """Nothing queued and op on t runs native: the caller can make the one
        torch.distributed call on this thread and skip the op's machinery
        (never under PZ_CHECK_PLANS, which checks every op's spec)."""
        return (not self._pending and not self._worker.busy() and not self._check_plans
                and self._plans.op(op, t.dtype, t.nbytes) == "native")

    # --- the thin native path, for an adapter beside the queue -----------------
    def native_ready(self, op: str, t: torch.Tensor) -> bool:
        """Whether op on t (a valid, contiguous tensor: the caller checked)
        would run torch's own op now: a native plan with nothing queued before
        it, t's dtype one the group's backend moves as it is. The pz backend
        then posts it itself (post_native), so a native op costs what torch's
        own call costs plus these checks (not under PZ_CHECK_PLANS, which
        agrees every op's spec)."""
        return (self._native and not self._closed and self._inside is None and t.dtype in self._as_is
                and self._idle_native(op, t))  # another thread inside an op: the full path raises "not thread-safe"

    def post_native(self, op: str, post, sent: int):
        """post(pg): torch's own op on this Communicator's group, posted now
        and counted in the stats as a native op moving sent bytes. Returns
        its Work, not waited for (after native_ready said yes)."""
        t0 = time.perf_counter()
        w = post(self.group.pg)
        self._record(op, "native", t0, sent, sent)
        return w

    def count_native(self, op: str, calls: int, sent: int, seconds: float) -> None:
        """calls native ops of op, moving sent bytes, that an adapter posted itself (the pz backend's gate)."""
        self._stats.add(op, "native", calls, sent, sent, seconds)

    def _native_now(self, op: str, t: torch.Tensor, async_op: bool) -> bool:
        """A blocking collective that runs native: auto then adds only this
        check, the native wait (_await_native) and the stats to what torch costs."""
        return (not async_op or async_op is _TORCH_WORK) and self._native and self._idle_native(op, t)

    def _await_native(self, works, deadline: Deadline, detached: bool = False) -> None:
        """Finish native transfers the way torch.distributed does: on NCCL,
        order the current stream after them and return (no host wait, so auto
        costs what torch costs); on gloo, wait bounded by the deadline
        (detached: on a helper thread, for works whose wait ignores it)."""
        works = works if isinstance(works, list) else [works]
        if self._stream_native:
            for w in works:
                w.wait()
        elif detached:
            self.tp.local.wait_detached(works, deadline)
        else:
            self.tp.wait(works, deadline)

    def _native_done(self, op: str, t0: float, works, sent: int, deadline: Deadline, detached: bool = False) -> None:
        self._await_native(works, deadline, detached)
        self._record(op, "native", t0, sent, sent)

    def _run_native(self, op: str, start, sent: int, async_op=False):
        """The fast path of _native_now: torch's op and the wait every native
        plan takes, nothing else (_TORCH_WORK: torch's Work, not waited for)."""
        if async_op is _TORCH_WORK:
            return self.post_native(op, lambda pg: start(), sent)
        t0 = time.perf_counter()
        self._native_done(op, t0, start(), sent, Deadline(self.timeout))

    # --- collectives ------------------------------------------------------------
    # A collective's plan is a function of (op, dtype, numel) and the agreed
    # policy state, so every rank of a correct program picks the same one.
    # Non-native plans then swap a spec (agree.collective) that carries the
    # plan and the policy fingerprint; native plans skip it unless
    # PZ_CHECK_PLANS is on.
    def _collective(self, op: str, dtype: torch.dtype, nbytes: int, fields, start_native, sent: int, algorithm,
                    async_op: bool, detached: bool = False):
        """Plan, agree, then torch's op or the algorithm (call, coded) -> (raw, wire, streams)."""
        def run(sms):
            call = self._call(sms)
            t0, plan = time.perf_counter(), self._plans.op(op, dtype, nbytes)
            if self._check_plans or plan != "native":
                self._agree(call, op, plan, dtype, fields)
            if plan == "native":
                return self._native_done(op, t0, start_native(), sent, call.deadline, detached=detached)
            t1 = time.perf_counter()  # the ranks met at the swap: what follows is the plan's own time
            raw, wire, streams = algorithm(call, self._plans.coded(plan, dtype, nbytes))
            if not self._mixed and (plan == "compressed" or (plan == "raw" and self._learns_raw)):
                self.policy.note(op, dtype, nbytes, self.world, time.perf_counter() - t1, raw=plan == "raw")
            if streams is not None:
                self._observe(streams)
            self._record(op, plan, t0, raw, wire)
        return self._submit(run, async_op)

    @exclusive
    def broadcast(self, t: torch.Tensor, src: int, async_op: bool = False, *, torch_work: bool = False):
        async_op = _TORCH_WORK if async_op and torch_work else async_op
        self._check(t, "broadcast tensor")
        self._rank_arg(src, "src")

        def start():
            return self.group.broadcast(*self._bytes(t), src)

        sent = t.nbytes * (self.world - 1) if self.rank == src else 0
        if self._native_now("broadcast", t, async_op):
            return self._run_native("broadcast", start, sent, async_op)

        def algorithm(call, coded):
            res = coll.broadcast(self.tp, t, src, coded, call)
            # Every rank sees each piece's stream once: the source its own, the others the received ones.
            return res.raw_bytes, res.wire_bytes, res.streams
        return self._collective("broadcast", t.dtype, t.nbytes, [t.numel(), src], start, sent, algorithm, async_op)

    @exclusive
    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False, *,
                          torch_work: bool = False):
        async_op = _TORCH_WORK if async_op and torch_work else async_op
        self._check(out, "all_gather output")
        self._check(inp, "all_gather input")
        if out.dtype != inp.dtype or out.numel() != self.world * inp.numel():
            raise ValueError(f"all_gather output must be {inp.dtype} with world_size * input numel = "
                             f"{self.world * inp.numel()} elements, got {out.dtype} with {out.numel()}")
        own = out.data_ptr() + self.rank * inp.nbytes  # where this rank's slot of out starts
        if overlaps(out, inp) and not (inp.data_ptr() == own or inp.numel() == 0):
            inp = inp.clone()  # overlapping out anywhere but its own slot: receives would overwrite it

        def start():
            return self.group.all_gather(*self._bytes(out, inp))

        sent = inp.nbytes * (self.world - 1)
        if self._native_now("all_gather", inp, async_op):
            return self._run_native("all_gather", start, sent, async_op)

        def algorithm(call, coded):
            res = coll.all_gather(self.tp, out, inp, coded, call)
            return res.raw_bytes, res.wire_bytes, res.streams  # every rank's stream, once each, on every rank
        return self._collective("all_gather", inp.dtype, inp.nbytes, [inp.numel()], start, sent, algorithm,
                                async_op)

    all_gather_into_tensor = all_gather_single

    @exclusive
    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False, *,
                              torch_work: bool = False):
        async_op = _TORCH_WORK if async_op and torch_work else async_op
        op = ReduceOp.of(op)
        self._check(out, "reduce_scatter output", reduce=True)
        self._check(inp, "reduce_scatter input", reduce=True)
        if out.dtype != inp.dtype or inp.numel() != self.world * out.numel():
            raise ValueError(f"reduce_scatter input must be {out.dtype} with world_size * output numel = "
                             f"{self.world * out.numel()} elements, got {inp.dtype} with {inp.numel()}")
        if overlaps(out, inp):
            inp = inp.clone()

        def start():
            return self.group.reduce_scatter(out, inp, op.native())

        def algorithm(call, coded):
            res = coll.reduce_scatter(self.tp, out, inp, op, coded, call)
            return res.raw_bytes, res.wire_bytes, None
        sent = out.nbytes * (self.world - 1)
        if async_op is _TORCH_WORK and self._native_now("reduce_scatter", inp, async_op):
            return self._run_native("reduce_scatter", start, sent, async_op)  # torch's Work, waited as torch's
        # gloo's reduce_scatter ignores wait(timeout): wait on a helper thread.
        return self._collective("reduce_scatter", inp.dtype, inp.nbytes, [inp.numel(), list(ReduceOp).index(op)],
                                start, sent, algorithm, async_op, detached=True)

    reduce_scatter_tensor = reduce_scatter_single

    @exclusive
    def all_reduce(self, t: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False, *, torch_work: bool = False):
        async_op = _TORCH_WORK if async_op and torch_work else async_op
        op = ReduceOp.of(op)
        self._check(t, "all_reduce tensor", reduce=True)

        def start():
            return self.group.all_reduce(t, op.native())

        sent = 2 * t.nbytes * (self.world - 1) // self.world
        if self._native_now("all_reduce", t, async_op):
            return self._run_native("all_reduce", start, sent, async_op)

        def algorithm(call, coded):
            if self._hier:
                rs, ag = coll.hier_all_reduce(self.tp, t, op, coded, call, self.domains)
            else:
                rs, ag = coll.all_reduce(self.tp, t, op, coded, call)
            # The all-gather phase: every shard's stream on every rank.
            return rs.raw_bytes + ag.raw_bytes, rs.wire_bytes + ag.wire_bytes, ag.streams
        return self._collective("all_reduce", t.dtype, t.nbytes, [t.numel(), list(ReduceOp).index(op)], start, sent,
                                algorithm, async_op)

    @exclusive
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
        if overlaps(out, inp):
            inp = inp.clone()  # in place: receives would overwrite rows not yet sent

        def run(sms):
            call = self._call(sms)
            t0 = time.perf_counter()
            # Uneven splits give each rank different bytes, so auto decides
            # from the agreed split matrix (its heaviest rank), after the swap
            # that every rank checks as a whole, so all raise alike.
            plan = "decided from the split matrix" if self.compress == "auto" else \
                self._plans.op("all_to_all", inp.dtype, inp.nbytes)
            mat = self._agree(call, "all_to_all", plan, inp.dtype, [row], splits=(in_splits, out_splits))
            if self.compress == "auto":
                heaviest = max(sum(r[:self.world]) for r in mat) * row * inp.element_size()
                plan = self._plans.op("all_to_all", inp.dtype, heaviest)
            if plan == "native":
                w = self.group.all_to_all(native.row_bytes(out), native.row_bytes(inp), out_splits, in_splits)
                sent = inp.nbytes - in_splits[self.rank] * (inp.nbytes // max(inp.shape[0], 1))
                return self._native_done("all_to_all", t0, w, sent, call.deadline)
            res = coll.all_to_all(self.tp, out, inp, out_splits, in_splits,
                                  self._plans.coded(plan, inp.dtype, inp.nbytes), call)
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

    # --- point to point -------------------------------------------------------
    # One path (p2p.py): each message carries its dtype, size and plan, the
    # sender's choice; a receive matches the peer's sends in posting order.
    # isend/irecv posted before a wait() go out as one group, like
    # torch.distributed.batch_isend_irecv: each message names its group's
    # count for the pair and tag, and a peer whose group differs raises
    # MismatchError. Tags match as torch's do: per (source, destination, tag).
    @exclusive
    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._check(t, "send tensor")
        self._peer(dst)
        self._post_p2p("send", t, dst, tag).wait()

    @exclusive
    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> None:
        self._check(t, "recv tensor")
        self._peer(src)
        self._post_p2p("recv", t, src, tag).wait()

    @exclusive
    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Work:
        self._check(t, "send tensor")
        self._peer(dst)
        return self._post_p2p("send", t, dst, tag)

    @exclusive
    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Work:
        self._check(t, "recv tensor")
        self._peer(src)
        return self._post_p2p("recv", t, src, tag)

    @exclusive
    def recv_tensor(self, src: int, tag: int = 0, *, max_bytes: Optional[int] = None) -> torch.Tensor:
        """Receive a message into a new flat tensor of the dtype and element
        count its sender announces (every message carries both), on this
        Communicator's device: for payloads whose size only the sender knows
        (a delta stream, a coded blob). A message over max_bytes is refused:
        MismatchError on both ranks, the pair goes on."""
        return self.irecv_tensor(src, tag, max_bytes=max_bytes).result()

    @exclusive
    def irecv_tensor(self, src: int, tag: int = 0, *, max_bytes: Optional[int] = None) -> Work:
        """recv_tensor, posted: Work.result() waits and returns the tensor."""
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Integral)
                                      or max_bytes < 0):
            raise ValueError(f"max_bytes must be None or an int >= 0, got {max_bytes!r}")
        self._peer(src)
        return self._post_p2p("recv", _Announced(None if max_bytes is None else int(max_bytes)), src, tag)

    def _post_p2p(self, kind, t, peer, tag) -> Work:
        if isinstance(tag, bool) or not isinstance(tag, numbers.Integral) or not 0 <= tag < 1 << 62:
            raise ValueError(f"tag must be an int >= 0, got {tag!r}")
        fut = concurrent.futures.Future()
        with self._p2p_lock:  # with the SM budget where it is posted: the path's threads have none
            self._pending.append((kind, t, peer, int(tag), fut, self._budget()))
        return Work(fut, self._flush)

    def _flush(self, inline: bool = False) -> None:
        """Post the pending isend/irecv group on the point-to-point path (it runs on its own threads).
        Work.wait calls it from any thread: it takes its own lock, not the op entry's."""
        with self._p2p_lock:
            pending, self._pending = self._pending, []
            self._post_group(pending)

    def _post_group(self, pending: list) -> None:
        counts: dict = {}
        for kind, _t, peer, tag, _f, _b in pending:
            counts[kind, peer, tag] = counts.get((kind, peer, tag), 0) + 1
        for kind, t, peer, tag, fut, sms in pending:
            group = counts[kind, peer, tag]
            try:
                if isinstance(t, _Announced):
                    inner = self._p2p.irecv_new(self.device, peer, tag, group, sms or None, t.max_bytes)
                else:
                    post = self._p2p.isend if kind == "send" else self._p2p.irecv
                    inner = post(t, peer, tag, group=group, max_sms=sms or None)
            except BaseException as e:  # noqa: BLE001 - a closed path: the op's Work raises it
                fut.set_exception(e)
                continue
            inner.add_done_callback(lambda f, fut=fut: _settle(fut, f))

    @exclusive
    def close(self) -> None:
        """Finish queued ops, release the worker and the transport; later ops raise."""
        if self._closed:
            return
        try:
            self._flush()
            self._worker.drain()
            self._p2p.drain()
        finally:
            self._release()

    def _release(self) -> None:
        """The worker thread, the transport (its endpoints and threads) and the private group, each even if
        another fails to let go."""
        self._closed = True
        try:
            if self._worker is not None:
                self._worker.shutdown()
            if self._p2p is not None:
                self._p2p.close()
        finally:
            try:
                if self.tp is not None:
                    self.tp.close()
            finally:
                try:
                    if self._channel is not None:
                        self._channel.close()
                finally:
                    self.group.close()

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world={self.world}, compress={self.compress!r}, {self.backend})"


def _settle(fut: concurrent.futures.Future, inner: concurrent.futures.Future) -> None:
    e = inner.exception()
    if e is not None:
        fut.set_exception(e)
    else:
        fut.set_result(inner.result())


@dataclass(frozen=True)
class _Announced:
    """A pending receive whose tensor the sender's frame sizes (recv_tensor)."""
    max_bytes: Optional[int]


def check_options(compress: str, options: dict) -> None:
    """A hook's Communicator arguments, checked when the hook is made (not
    at its first collective): compress and the rest of Communicator's."""
    check_args(compress)
    try:
        inspect.signature(Communicator).bind(None, compress, **options)
    except TypeError as e:
        raise TypeError(f"a pz hook's options are pz.Communicator's: {e}") from None


def _given(arg, setting):
    return setting if arg is None else arg


# The policy overrides' ranges: (lowest, whether the lowest is allowed, highest excluded).
_RANGES = {"link_gbps": (0.0, False, math.inf), "codec_gbps": (0.0, False, math.inf),
           "latency_us": (0.0, True, math.inf), "margin": (0.0, True, 1.0)}


def overrides(*given) -> tuple:
    """The policy overrides, each (value, name, the PZ_* variable it came
    from or a false value): None or a number in its range, else ValueError
    naming the argument (and the variable it came from)."""
    out = []
    for v, name, env in given:
        if v is None:
            out.append(None)
            continue
        lo, closed, hi = _RANGES[name.rsplit(".", 1)[-1]]
        ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and (lo <= v if closed else lo < v) and v < hi
        if not ok:
            where = f" (from {env})" if env else ""
            rng = f"{'>=' if closed else '>'} {lo:g} and < {hi:g}"
            raise ValueError(f"{name}{where} must be None or a number {rng}, got {v!r}")
        out.append(float(v))
    return tuple(out)
