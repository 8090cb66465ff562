"""Cost model that picks, per op, dtype and size, between the native
(uncompressed) collective and the compressed plan.

Link: alpha (latency) + beta (seconds per byte), measured once per group with
a ring exchange. Codec: measured compress/decompress throughput per dtype on
this device. Ratio: a running estimate per dtype, updated only from streams
every rank sees alike. All inputs that feed a decision are agreed across ranks
(the slowest rank's figures, and the margin), so every rank picks the same
plan (the rule: docs/COMM.md). Overrides: arguments or PZ_LINK_GBPS,
PZ_LINK_LATENCY_US, PZ_CODEC_GBPS, PZ_POLICY_MARGIN.
"""
from __future__ import annotations

import os
import time
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import codec
from .._dtypes import CODED
from .transport import Transport
from .wire import piece_bytes

PRIOR_RATIO = {torch.bfloat16: 0.67, torch.float16: 0.85, torch.float32: 0.84,
               torch.float8_e4m3fn: 0.78, torch.float8_e5m2: 0.70}
# group -> {overrides: (Calibration, agreed margin)}; weak, so a destroyed
# group's figures never serve a new group that reuses its address.
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_NATIVE_MEASURED = ("send", "all_gather", "all_reduce")
# Host time of a compressed exchange beyond its latency rounds (alpha, measured
# with the same post-and-wait, already holds most of it): launches and header
# reads, once and per wave, from PZ_TRACE timelines on H200 (docs/COMM.md).
HOST_EXCHANGE_S, HOST_WAVE_S = 200e-6, 100e-6


@dataclass(frozen=True)
class TransportCosts:
    """What a compressed exchange costs beyond its bytes, per transport:
    latency rounds (p2p, a collective's first phase, all_reduce's second) and
    host time per exchange and per wave."""
    p2p_rounds: int = 3         # torch: control, fixed parts, tails
    coll_rounds: int = 3        # torch: spec, fixed parts, tails
    second_phase_rounds: int = 2
    host_exchange_s: float = HOST_EXCHANGE_S
    host_wave_s: float = HOST_WAVE_S


TORCH_COSTS = TransportCosts()
# The fabric engine sends each coded piece as one sized message: control (or
# spec) then one round. Host time per exchange: a compressed 4 MiB send over
# tcp;ofi_rxm between two H200 ranks took 0.9 ms more than ratio x raw
# (bench/results/h200-fabric.json, 2026-12-01): the header read-back and
# the staging of the sized message's first chunk before its length is known.
FABRIC_COSTS = TransportCosts(p2p_rounds=2, coll_rounds=2, second_phase_rounds=1, host_exchange_s=900e-6)


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

    def describe(self) -> str:
        bf = torch.bfloat16
        return (f"link {1e-9 / self.beta if self.beta else float('inf'):.2f} GB/s, {self.alpha * 1e6:.1f} us; "
                f"bf16 codec {1e-9 / self.compress.get(bf, 1e-30):.1f}/{1e-9 / self.decompress.get(bf, 1e-30):.1f} "
                f"GB/s ({self.source})")


def _env_float(name: str) -> Optional[float]:
    v = os.environ.get(name)
    return float(v) if v else None


class Policy:
    def __init__(self, link_gbps: Optional[float] = None, latency_us: Optional[float] = None,
                 codec_gbps: Optional[float] = None, margin: Optional[float] = None):
        self.link_gbps = link_gbps if link_gbps is not None else _env_float("PZ_LINK_GBPS")
        self.latency_us = latency_us if latency_us is not None else _env_float("PZ_LINK_LATENCY_US")
        self.codec_gbps = codec_gbps if codec_gbps is not None else _env_float("PZ_CODEC_GBPS")
        m = margin if margin is not None else _env_float("PZ_POLICY_MARGIN")
        self.margin = 0.05 if m is None else m
        self.ratio = dict(PRIOR_RATIO)
        self.costs = TORCH_COSTS  # the Communicator sets its transport's
        self.cross_pairs: tuple = ()  # mixed clusters: the rank pairs in different domains (the Communicator sets)
        self.cal: Optional[Calibration] = None
        self._decided: Dict[tuple, str] = {}

    # --- calibration -----------------------------------------------------
    def _key(self, tp: Transport) -> tuple:
        return (tp.name, tp.world, str(tp.device.type), self.link_gbps, self.latency_us, self.codec_gbps, self.margin)

    def cached_digest(self, tp: Transport, group) -> int:
        """A hash of this rank's cached calibration for the group (0: none),
        so the constructor reuses a cache only where every rank holds the same one."""
        hit = _CACHE.get(group, {}).get(self._key(tp))
        return 0 if hit is None else (zlib.crc32(repr(hit).encode()) | 1)

    def calibrate(self, tp: Transport, group, timeout: float, cache_group, cached: bool, swap,
                  torch_native: bool = True, all_gpu: Optional[bool] = None) -> Calibration:
        """Measure (or, where every rank has it cached, reuse) the constants,
        and agree on them: each rank ends with the same figures and margin.
        Collective: every rank calls it with the same `cached` (the
        constructor's handshake agrees on it). Every wait is bounded by
        timeout. Figures are cached per cache_group (the caller's group:
        each Communicator measures over its own private copy of it).
        swap(values): every rank's list of floats, over the Communicator's
        transport. torch_native: the group has torch collectives to measure.
        all_gpu: every rank moves GPU tensors (default: this rank's device says)."""
        key = self._key(tp)
        if all_gpu is None:
            all_gpu = tp.device.type == "cuda"
        if cached:
            self.cal, self.margin = _CACHE[cache_group][key]
            return self.cal
        alpha, beta = self._measure_link(tp, timeout, all_gpu)
        w1 = max(tp.world - 1, 1)
        if torch_native:
            native = {op: self._measure_native(op, tp, group, timeout) for op in _NATIVE_MEASURED}
        else:  # no torch collective to fall back to: "native" is a raw exchange over the same transport
            native = {"send": (alpha, beta), "all_gather": (w1 * alpha, w1 * beta),
                      "all_reduce": (2 * w1 * alpha, 2 * w1 * beta / max(tp.world, 1))}
        if self.link_gbps:
            beta = 1e-9 / self.link_gbps
            native = {"send": (native["send"][0], beta),
                      "all_gather": (native["all_gather"][0], beta * max(tp.world - 1, 1)),
                      "all_reduce": (native["all_reduce"][0], beta * 2 * max(tp.world - 1, 1) / max(tp.world, 1))}
        if self.latency_us is not None:
            alpha = self.latency_us * 1e-6
        comp, decomp = {}, {}
        for dt in CODED:
            if self.codec_gbps:
                comp[dt] = decomp[dt] = 1e-9 / self.codec_gbps
            else:
                comp[dt], decomp[dt] = self._measure_codec(dt, tp.device)
        # Agree on the slowest rank's figures so every rank decides alike.
        vec = ([alpha, beta] + [comp[d] for d in CODED] + [decomp[d] for d in CODED]
               + [v for op in _NATIVE_MEASURED for v in native[op]] + [self.margin])
        rows = swap(vec)
        v = [max(col) for col in zip(*rows)]
        self.margin = v[-1]
        n = len(CODED)
        source = "overridden" if (self.link_gbps and self.codec_gbps) else "measured"
        at = 2 + 2 * n
        self.cal = Calibration(v[0], v[1], dict(zip(CODED, v[2:2 + n])), dict(zip(CODED, v[2 + n:at])), source,
                               {op: tuple(v[at + 2 * i: at + 2 * i + 2]) for i, op in enumerate(_NATIVE_MEASURED)},
                               [(dict(zip(CODED, r[2:2 + n])), dict(zip(CODED, r[2 + n:at]))) for r in rows])
        _CACHE.setdefault(cache_group, {})[key] = (self.cal, self.margin)
        return self.cal

    def fingerprint(self, dtype: torch.dtype) -> int:
        """A hash of everything a decision for dtype reads: equal on every
        rank when the agreement rule holds (PZ_CHECK_PLANS compares it)."""
        c = self.cal
        facts = (self.margin, self.ratio.get(dtype), self.costs, None if c is None else
                 (c.alpha, c.beta, c.compress.get(dtype), c.decompress.get(dtype), sorted(c.native.items()),
                  [(cr.get(dtype), dr.get(dtype)) for cr, dr in c.per_rank]))
        return zlib.crc32(repr(facts).encode())

    @staticmethod
    def _measure_link(tp: Transport, timeout: float, all_gpu: bool):
        if tp.world == 1:
            return 0.0, 0.0
        # Sizes every rank agrees on (a mixed cluster's CPU ranks set them for all).
        small, big = (64 << 10, 16 << 20) if all_gpu else (16 << 10, 2 << 20)
        nxt, prv = (tp.rank + 1) % tp.world, (tp.rank - 1) % tp.world

        def ring(size):
            a = torch.empty(size, dtype=torch.uint8, device=tp.device)
            b = torch.empty(size, dtype=torch.uint8, device=tp.device)
            return lambda: tp.wait(tp.post([("send", a, nxt), ("recv", b, prv)]), timeout)

        return _alpha_beta(ring, small, big, tp.device)

    @staticmethod
    def _measure_native(op: str, tp: Transport, group, timeout: float):
        """(alpha, beta per input byte) of torch.distributed's own collective."""
        if tp.world == 1:
            return 0.0, 0.0
        small, big = (256 << 10, 32 << 20) if tp.device.type == "cuda" else (16 << 10, 2 << 20)
        from .collectives import all_gather_native

        def collective(size):
            t = torch.zeros(size // 2, dtype=torch.bfloat16, device=tp.device)
            if op == "send":  # one way, in pairs (0 -> 1, 2 -> 3, ...): what a p2p send sees
                peer = tp.rank ^ 1
                if peer >= tp.world:
                    return lambda: None
                kind = "send" if tp.rank % 2 == 0 else "recv"
                return lambda: tp.wait(tp.post([(kind, t, peer)]), timeout)
            out = torch.empty(tp.world * t.numel(), dtype=t.dtype, device=tp.device)
            if op == "all_gather":
                def run():
                    tp.wait([all_gather_native(out, t, group=group, async_op=True)], timeout)
            else:
                def run():
                    tp.wait([dist.all_reduce(t, group=group, async_op=True)], timeout)
            run()  # warm-up
            return run

        return _alpha_beta(collective, small, big, tp.device)

    @staticmethod
    def _measure_codec(dtype: torch.dtype, device: torch.device):
        # One pipeline piece's worth on GPU: the cost a transfer pays per piece.
        nbytes = (64 << 20) if device.type == "cuda" else (1 << 20)
        n = nbytes // torch.empty(0, dtype=dtype).element_size()
        g = torch.Generator(device="cpu").manual_seed(0)
        t = (torch.randn(n, generator=g) * 0.02).to(dtype).to(device)
        buf = codec._compress_padded(t)  # warm-up (and module load on GPU)
        out = torch.empty_like(t)
        codec.decompress(buf, out=out, check=True)
        best_c = best_d = float("inf")
        for _ in range(2):
            _sync(device)
            t0 = time.perf_counter()
            buf = codec._compress_padded(t)
            _sync(device)
            t1 = time.perf_counter()
            codec.decompress(buf, out=out, check=True)
            _sync(device)
            t2 = time.perf_counter()
            best_c, best_d = min(best_c, t1 - t0), min(best_d, t2 - t1)
        return best_c / nbytes, best_d / nbytes

    # --- decisions ---------------------------------------------------------
    def predict(self, op: str, dtype: torch.dtype, nbytes: int, world: int):
        """(native seconds, compressed seconds) for this rank."""
        c = self.cal
        a, b = c.alpha, c.beta
        r = self.ratio.get(dtype, 1.0)
        cc, cd = c.compress.get(dtype, 0.0), c.decompress.get(dtype, 0.0)
        w1 = max(world - 1, 1)
        # Latency rounds of the compressed plans: p2p swaps control messages,
        # collectives a spec (then derive the control messages); then fixed
        # parts and tails. all_reduce's second phase needs no new spec.
        k = self.costs
        p2p_rounds, coll_rounds, second_phase_rounds = k.p2p_rounds, k.coll_rounds, k.second_phase_rounds

        def piped(n, compress, wire, decompress, rounds):
            # Large transfers move as pieces: compress, wire and decompress
            # overlap, so the slowest stage sets the pace, plus one piece's
            # worth of the other two to fill and drain the pipeline, plus the
            # host's work per exchange and per wave (launches, header reads).
            piece = max(piece_bytes(int(n)), 1)
            stages = (compress, wire, decompress)
            host = k.host_exchange_s + k.host_wave_s * max(1, -(-n // piece))
            return max(stages) + piece / max(n, 1) * (sum(stages) - max(stages)) + rounds * a + host

        if op in ("send", "recv"):
            na, nb = c.native.get("send", (a, b))
            return na + nbytes * nb, piped(nbytes, nbytes * cc, r * nbytes * nb, nbytes * cd, p2p_rounds)
        if op == "broadcast":
            return (a * w1.bit_length() + nbytes * b,
                    piped(nbytes, nbytes * cc, w1 * r * nbytes * b, nbytes * cd, coll_rounds))
        if op == "all_gather":
            na, nb = c.native.get("all_gather", (w1 * a, w1 * b))
            return na + nbytes * nb, piped(nbytes, nbytes * cc, w1 * r * nbytes * b, w1 * nbytes * cd, coll_rounds)
        s = nbytes / max(world, 1)
        one_phase_native = w1 * (a + s * b)
        one_phase_coded = piped(s, w1 * s * cc, w1 * s * r * b, w1 * s * cd, coll_rounds)
        if op == "all_to_all":
            return one_phase_native, one_phase_coded
        if op == "reduce_scatter":
            return one_phase_native, one_phase_coded + nbytes * 1e-11
        if op == "all_reduce":
            na, nb = c.native.get("all_reduce", (2 * w1 * a, 2 * w1 * b / max(world, 1)))
            return na + nbytes * nb, one_phase_coded + piped(s, s * cc, w1 * s * r * b, w1 * s * cd,
                                                             second_phase_rounds)
        raise ValueError(f"unknown op {op}")

    def pair_pays(self, dtype: torch.dtype, nbytes: int, i: int, j: int) -> bool:
        """Whether compressing nbytes between ranks i and j beats sending them
        raw on the agreed link, with the slower end's codec at each stage.
        Symmetric in (i, j) and read from agreed figures, so both ends agree."""
        c = self.cal
        if dtype not in CODED or nbytes == 0 or c is None or not c.per_rank:
            return False
        (ci, di), (cj, dj) = c.per_rank[i], c.per_rank[j]
        cc, cd = max(ci[dtype], cj[dtype]), max(di[dtype], dj[dtype])
        r = self.ratio.get(dtype, 1.0)
        raw = c.alpha + nbytes * c.beta
        piece = max(piece_bytes(int(nbytes)), 1)
        stages = (nbytes * cc, r * nbytes * c.beta, nbytes * cd)
        coded = (max(stages) + piece / nbytes * (sum(stages) - max(stages)) + self.costs.p2p_rounds * c.alpha
                 + self.costs.host_exchange_s)
        return coded < raw * (1 - self.margin)

    def any_pair_pays(self, dtype: torch.dtype, nbytes: int) -> bool:
        """Whether some pair of self.cross_pairs gains from compressing nbytes
        (cached like choose(): it is on every mixed-cluster op's path)."""
        key = ("pairs", dtype, nbytes, id(self.cal), self.ratio.get(dtype), self.margin)
        hit = self._decided.get(key)
        if hit is None:
            hit = any(self.pair_pays(dtype, nbytes, i, j) for i, j in self.cross_pairs)
            if len(self._decided) > 4096:
                self._decided.clear()
            self._decided[key] = hit
        return hit

    def choose(self, op: str, dtype: torch.dtype, nbytes: int, world: int) -> str:
        key = (op, dtype, nbytes, world, id(self.cal), self.ratio.get(dtype), self.margin)
        plan = self._decided.get(key)
        if plan is None:  # cached: the decision is on every call's path
            if dtype not in CODED or nbytes == 0 or world == 1:
                plan = "native"
            else:
                native, coded = self.predict(op, dtype, nbytes, world)
                plan = "compressed" if coded < native * (1 - self.margin) else "native"
            if len(self._decided) > 4096:
                self._decided.clear()
            self._decided[key] = plan
        return plan

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


def _alpha_beta(make_run, small: int, big: int, device: torch.device):
    """(alpha, beta) fitted to the best of 3 timed runs of make_run(size)() at two sizes."""
    times = {}
    for size in (small, big):
        run = make_run(size)
        best = float("inf")
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            run()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        times[size] = best
    beta = max((times[big] - times[small]) / (big - small), 1e-13)
    return max(times[small] - small * beta, 0.0), beta


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
