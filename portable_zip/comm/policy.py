"""Cost model that picks, per op, dtype and size, between the native
(uncompressed) collective and the compressed plan. Decisions only: the
figures come from calibration.py.

Link: alpha (latency) + beta (seconds per byte). Codec: compress/decompress
seconds per byte per dtype on this device. Ratio: a running estimate per
dtype, updated only from streams every rank sees alike. All inputs that feed
a decision are agreed across ranks (the slowest rank's figures, and the
margin), so every rank picks the same plan (the rule: docs/COMM.md).
Overrides: the Communicator's arguments, or PZ_LINK_GBPS, PZ_LINK_LATENCY_US,
PZ_CODEC_GBPS, PZ_POLICY_MARGIN (portable_zip/comm/settings.py).

The model learns from what it sees: a compressed collective's time, from its
spec swap to its end, over the model's prediction, is this rank's
observation; it rides in the next spec swap, where every rank takes the
slowest rank's. `slowdown`, the factor on every compressed prediction, moves
halfway toward the least of the last three such agreed observations: a plan
that keeps running slower than predicted (cores shared with training, a link
busier than at calibration) is re-judged, alike on every rank, and one
hiccup (a GC pause, a checkpoint's I/O) is not. Once every size has gone
native nothing is observed any more: the factor then holds until the
Communicator is made again.

Where the group has no torch collectives (the fabric between single-rank
domains), the plan compression competes with is the raw pipeline, and it
swaps a spec too: its time over the native prediction rides in the same
word (negated), and `raw_slowdown`, the factor on the collectives' native
predictions, learns it the same way. Only all_gather, reduce_scatter and
all_reduce teach it (the ops whose raw pipeline moves what the native model
assumes; a raw broadcast is flat, not a tree), and only where the
prediction is at least the host cost of an exchange (1 MiB at least):
below that a raw op's time is mostly host work. What a raw op learns
includes its host work, which the native model leaves out, so the
comparison with a compressed plan (whose prediction has its own) is fair at
the sizes learned; as one factor, not a host term, it overstates raw at
much larger sizes, where compression mostly wins anyway. Each agreed
compressed observation takes 2% of its excess (and of the kept
observations') back toward 1, so once compression has won every size for
a while a raw op is tried again. Point to point keeps its own
judgement (LinkSeen). The factors move in steps of 1/1024, so decisions
stay cached between steps.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from ..codec import CODED
from .pieces import piece_bytes
from .transports.base import TransportCosts

P2P_OPS = ("send", "recv")  # point to point: the transport's host constant, and LinkSeen's judgement of the link
PRIOR_RATIO = {torch.bfloat16: 0.67, torch.float16: 0.85, torch.float32: 0.84,
               torch.float8_e4m3fn: 0.78, torch.float8_e5m2: 0.70}


@dataclass
class Calibration:
    alpha: float                      # seconds per message round (p2p)
    beta: float                       # seconds per byte on one link (p2p, both directions busy)
    compress: Dict[torch.dtype, float] = field(default_factory=dict)    # seconds per input byte
    decompress: Dict[torch.dtype, float] = field(default_factory=dict)
    source: str = "measured"
    # Native collectives measured as they run (NCCL's rings and channels can
    # beat what p2p suggests): (alpha, beta) per input byte.
    native: Dict[str, tuple] = field(default_factory=dict)
    # Every rank's own (compress, decompress) seconds per byte per dtype, for
    # per-pair decisions in mixed clusters (a GPU pair and a GPU-CPU pair differ).
    per_rank: List[tuple] = field(default_factory=list)
    # Host time per compressed exchange, measured on this transport (calibration.measure_exchange), in place
    # of the transport's constant; None: the constant.
    host_exchange_s: Optional[float] = None

    def describe(self) -> str:
        bf = torch.bfloat16
        host = "" if self.host_exchange_s is None else f"; {self.host_exchange_s * 1e6:.0f} us host per exchange"
        return (f"link {1e-9 / self.beta if self.beta else float('inf'):.2f} GB/s, {self.alpha * 1e6:.1f} us; "
                f"bf16 codec {1e-9 / self.compress.get(bf, 1e-30):.1f}/{1e-9 / self.decompress.get(bf, 1e-30):.1f} "
                f"GB/s{host} ({self.source})")


class Policy:
    def __init__(self, link_gbps: Optional[float] = None, latency_us: Optional[float] = None,
                 codec_gbps: Optional[float] = None, margin: Optional[float] = None,
                 costs: TransportCosts = TransportCosts(), cross_pairs: tuple = ()):
        self.link_gbps, self.latency_us, self.codec_gbps = link_gbps, latency_us, codec_gbps
        self.margin = 0.05 if margin is None else margin
        self.ratio = dict(PRIOR_RATIO)
        self.costs = costs  # the transport's
        self.cross_pairs = cross_pairs  # mixed clusters: the rank pairs in different domains
        self.cal: Optional[Calibration] = None
        self._decided: Dict[tuple, str] = {}
        self.slowdown = 1.0  # agreed: observed over predicted time of compressed plans (see the module's docstring)
        self.raw_slowdown = 1.0  # agreed: the same for raw plans, where they stand in for native ones
        self._heard: List[float] = []  # the last agreed observations (the slowest rank's each), newest last
        self._heard_raw: List[float] = []
        self._seen = 0       # this rank's latest observation, in thousandths (negative: a raw plan's), not yet reported

    def fingerprint(self, dtype: torch.dtype) -> int:
        """A hash of everything a decision for dtype reads: equal on every
        rank when the agreement rule holds (PZ_CHECK_PLANS compares it)."""
        c = self.cal
        facts = (self.margin, self.ratio.get(dtype), self.costs, self.slowdown, self.raw_slowdown, None if c is None else
                 (c.alpha, c.beta, c.compress.get(dtype), c.decompress.get(dtype), sorted(c.native.items()),
                  [(cr.get(dtype), dr.get(dtype)) for cr, dr in c.per_rank], c.host_exchange_s))
        return zlib.crc32(repr(facts).encode())

    # --- decisions ---------------------------------------------------------
    def predict(self, op: str, dtype: torch.dtype, nbytes: int, world: int, link: float = 1.0,
                streaming: bool = False):
        """(native seconds, compressed seconds) for this rank. Point to point
        only: link, how much slower than calibrated the link runs (LinkSeen);
        streaming, more messages queued behind this one, whose codec work
        overlaps this one's wire, so no pipeline fill is paid."""
        c = self.cal
        a, b = c.alpha, c.beta
        r = self.ratio.get(dtype, 1.0)
        cc, cd = c.compress.get(dtype, 0.0), c.decompress.get(dtype, 0.0)
        w1 = max(world - 1, 1)
        # A compressed plan runs over the same transport as the native op, with
        # a spec swap and at least as many rounds: never faster than the native
        # op's own measured latency (torch's all_gather, timed on a loaded host,
        # can take longer than the p2p model's rounds).
        # Latency rounds of the compressed plans: collectives swap a spec
        # (then derive the control messages), fixed parts and tails;
        # all_reduce's second phase needs no new spec. Point to point has
        # one, as raw does: its frame travels with the payload.
        k = self.costs
        coll_rounds, second_phase_rounds = k.coll_rounds, k.second_phase_rounds
        # Point to point keeps the transport's constant: the measured figure is a collective's (host_exchange).
        host_exchange = k.host_exchange_s if op in P2P_OPS else self.host_exchange()

        def piped(n, compress, wire, decompress, rounds, fill=True):
            # Large transfers move as pieces: compress, wire and decompress
            # overlap, so the slowest stage sets the pace, plus one piece's
            # worth of the other two to fill and drain the pipeline, plus the
            # host's work per exchange and per wave (launches, header reads).
            piece = max(piece_bytes(int(n)), 1)
            stages = (compress, wire, decompress)
            host = host_exchange + k.host_wave_s * max(1, -(-n // piece))
            filling = piece / max(n, 1) * (sum(stages) - max(stages)) if fill else 0.0
            return max(stages) + filling + rounds * a + host

        if op in P2P_OPS:
            na, nb = c.native.get("send", (a, b))
            nb *= link
            return na + nbytes * nb, max(na, piped(nbytes, nbytes * cc, r * nbytes * nb, nbytes * cd, 1, not streaming))
        if op == "broadcast":
            return (a * w1.bit_length() + nbytes * b,
                    piped(nbytes, nbytes * cc, w1 * r * nbytes * b, nbytes * cd, coll_rounds))
        if op == "all_gather":
            na, nb = c.native.get("all_gather", (w1 * a, w1 * b))
            return na + nbytes * nb, max(na, piped(nbytes, nbytes * cc, w1 * r * nbytes * b, w1 * nbytes * cd,
                                                   coll_rounds))
        s = nbytes / max(world, 1)
        one_phase_native = w1 * (a + s * b)
        one_phase_coded = piped(s, w1 * s * cc, w1 * s * r * b, w1 * s * cd, coll_rounds)
        if op == "all_to_all":
            return one_phase_native, one_phase_coded
        if op == "reduce_scatter":
            return one_phase_native, one_phase_coded + nbytes * 1e-11
        if op == "all_reduce":
            na, nb = c.native.get("all_reduce", (2 * w1 * a, 2 * w1 * b / max(world, 1)))
            return na + nbytes * nb, max(na, one_phase_coded + piped(s, s * cc, w1 * s * r * b, w1 * s * cd,
                                                                     second_phase_rounds))
        raise ValueError(f"unknown op {op}")

    # --- learning from what ran ------------------------------------------------
    # Only a plan slower than predicted is re-judged: a faster one (a link
    # set slower than the real one, say) leaves the model as it is.
    SLOWDOWN_RANGE = (1.0, 8.0)
    SLOWDOWN_WEIGHT = 0.5  # of each new target
    SLOWDOWN_RUN = 3       # agreed observations the target is the least of
    RAW_MIN_BYTES = 1 << 20  # raw ops below this teach nothing (their time is mostly host work)
    RAW_MIN_HOST = 1.0       # nor those predicted in less than this many host costs per exchange
    RAW_OPS = ("all_gather", "reduce_scatter", "all_reduce")  # raw plans that move what the native model assumes
    RAW_DECAY = 0.98         # of raw_slowdown's excess over 1, kept at each agreed compressed observation
    STEP = 1024              # factors move in 1/STEP: cached decisions survive a decay too small to matter
    SNAP = 0.03              # an excess below this is gone

    def note(self, op: str, dtype: torch.dtype, nbytes: int, world: int, seconds: float, raw: bool = False) -> None:
        """A compressed (raw: a raw) collective took seconds (from its spec
        swap to its end): kept as this rank's observation of the model's error."""
        if self.cal is None or nbytes == 0:
            return
        if raw and (nbytes < self.RAW_MIN_BYTES or op not in self.RAW_OPS):
            return
        if not raw and dtype not in CODED:
            return
        native, coded = self.predict(op, dtype, nbytes, world)
        if raw and native < self.RAW_MIN_HOST * self.host_exchange():
            return
        predicted = native if raw else coded
        if predicted > 0:
            seen = max(1, min(int(1000 * seconds / predicted), 1 << 30))
            self._seen = -seen if raw else seen

    def report(self) -> int:
        """The word this rank puts in its next spec swap: its latest
        observation (thousandths; negated for a raw plan's), or 0; each is
        reported once."""
        seen, self._seen = self._seen, 0
        return seen

    def heard(self, words) -> None:
        """Every rank's report from one spec swap (the same list on every
        rank): the slowest rank's observation joins the last few of its
        kind, and slowdown (raw_slowdown, for a raw plan's) moves toward the
        least of them. The same arithmetic on the same words, so every rank
        ends with the same values."""
        coded, raw = [w for w in words if w > 0], [-w for w in words if w < 0]
        if coded:
            if self.raw_slowdown > 1.0:  # stale raw observations fade with the factor: one hiccup still moves nothing
                self.raw_slowdown = self._step(1 + (self.raw_slowdown - 1) * self.RAW_DECAY)
                self._heard_raw = [1 + (h - 1) * self.RAW_DECAY for h in self._heard_raw] \
                    if self.raw_slowdown > 1.0 else []  # back at 1: they are stale
            self._heard, self.slowdown = self._fold(self._heard, max(coded), self.slowdown)
        if raw:
            self._heard_raw, self.raw_slowdown = self._fold(self._heard_raw, max(raw), self.raw_slowdown)

    def _fold(self, heard: List[float], word: int, factor: float) -> tuple:
        """(the last few observations, the factor) once the slowest rank's word joins them."""
        heard = (heard + [word / 1000.0])[-self.SLOWDOWN_RUN:]
        if len(heard) < self.SLOWDOWN_RUN:
            return heard, factor
        lo, hi = self.SLOWDOWN_RANGE
        a = self.SLOWDOWN_WEIGHT
        return heard, self._step(min(max((1 - a) * factor + a * min(heard), lo), hi))

    def _step(self, factor: float) -> float:
        """factor on the 1/STEP grid, 1.0 once within SNAP of it (the same arithmetic on every rank)."""
        return 1.0 if factor - 1.0 < self.SNAP else round(factor * self.STEP) / self.STEP

    def host_exchange(self) -> float:
        """Host seconds a compressed collective's exchange costs beyond its stages: measured where
        calibration did (the fabric, one domain), else the transport's constant."""
        c = self.cal
        return self.costs.host_exchange_s if c is None or c.host_exchange_s is None else c.host_exchange_s

    def forget(self) -> None:
        """Drop what runs taught so far (observations, slowdown, cached
        decisions): calibration's own exchanges are not the workload's. Every
        rank calls it at the same point, so the state stays agreed."""
        self.slowdown, self._heard, self._seen = 1.0, [], 0
        self.raw_slowdown, self._heard_raw = 1.0, []
        self._decided.clear()

    def pair_pays(self, dtype: torch.dtype, nbytes: int, i: int, j: int, p2p: bool = False) -> bool:
        """Whether compressing nbytes between ranks i and j beats sending them
        raw on the agreed link, with the slower end's codec at each stage.
        Symmetric in (i, j) and read from agreed figures, so both ends agree.
        A point-to-point message pays one latency round, raw or coded; a
        collective's pair, its rounds."""
        c = self.cal
        if dtype not in CODED or nbytes == 0 or c is None or not c.per_rank:
            return False
        (ci, di), (cj, dj) = c.per_rank[i], c.per_rank[j]
        cc, cd = max(ci[dtype], cj[dtype]), max(di[dtype], dj[dtype])
        r = self.ratio.get(dtype, 1.0)
        raw = c.alpha + nbytes * c.beta
        piece = max(piece_bytes(int(nbytes)), 1)
        stages = (nbytes * cc, r * nbytes * c.beta, nbytes * cd)
        rounds = 1 if p2p else self.costs.coll_rounds
        coded = (max(stages) + piece / nbytes * (sum(stages) - max(stages)) + rounds * c.alpha
                 + self.host_exchange())
        return self._pays(raw, coded)

    def any_pair_pays(self, dtype: torch.dtype, nbytes: int) -> bool:
        """Whether some pair of self.cross_pairs gains from compressing nbytes
        (cached like choose(): it is on every mixed-cluster op's path)."""
        key = ("pairs", dtype, nbytes, id(self.cal), self.ratio.get(dtype), self.margin, self.slowdown)
        hit = self._decided.get(key)
        if hit is None:
            hit = any(self.pair_pays(dtype, nbytes, i, j) for i, j in self.cross_pairs)
            if len(self._decided) > 4096:
                self._decided.clear()
            self._decided[key] = hit
        return hit

    def choose(self, op: str, dtype: torch.dtype, nbytes: int, world: int) -> str:
        key = (op, dtype, nbytes, world, id(self.cal), self.ratio.get(dtype), self.margin, self.slowdown,
               self.raw_slowdown)
        plan = self._decided.get(key)
        if plan is None:  # cached: the decision is on every call's path
            if dtype not in CODED or nbytes == 0 or world == 1:
                plan = "native"
            else:
                native, coded = self.predict(op, dtype, nbytes, world)
                raw = 1.0 if op in P2P_OPS else self.raw_slowdown
                plan = "compressed" if self._pays(native * raw, coded) else "native"
            if len(self._decided) > 4096:
                self._decided.clear()
            self._decided[key] = plan
        return plan

    def send_pays(self, dtype: torch.dtype, nbytes: int, link: float, streaming: bool = False,
                  coded: float = 1.0) -> bool:
        """Whether a message of nbytes gains from compression on a link
        running link times slower than calibrated (streaming: with more
        queued behind it), its compressed messages having run coded times
        slower than predicted: the sender's own judgement (point to point
        needs no agreement), not cached."""
        if self.cal is None or dtype not in CODED or nbytes == 0:
            return False
        native, c = self.predict("send", dtype, nbytes, 2, link, streaming)
        return self._pays(native, c * coded)

    def _pays(self, native: float, coded: float) -> bool:
        """The rule every decision applies: the coded prediction, times the
        agreed slowdown, beats the native one by the margin."""
        return coded * self.slowdown < native * (1 - self.margin)

    def observe(self, streams) -> None:
        """Update the running ratio from streams every rank saw alike."""
        per: Dict[torch.dtype, list] = {}
        for dtype, numel, total in streams:
            acc = per.setdefault(dtype, [0, 0])
            acc[0] += int(total)
            acc[1] += int(numel) * torch.empty(0, dtype=dtype).element_size()
        for dtype, (wire, raw) in per.items():
            if raw:
                self.ratio[dtype] = 0.5 * self.ratio.get(dtype, 1.0) + 0.5 * (wire / raw)
