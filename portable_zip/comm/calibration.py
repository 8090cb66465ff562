"""Measuring what the policy decides from, once per group: the link (a ring
exchange over the transport), torch's own collectives as they run, and the
codec on this device; then agreeing on the slowest rank's figures, so every
rank's policy holds the same numbers (the agreement rule, docs/COMM.md)."""
from __future__ import annotations

import dataclasses
import time
import weakref
import zlib
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .. import codec
from ..codec import CODED
from .deadline import Deadline
from .policy import Calibration, Policy
from .transports.base import RECV, SEND, Transport

# group -> {overrides: (Calibration, agreed margin)}; weak, so a destroyed
# group's figures never serve a new group that reuses its address.
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
NATIVE_MEASURED = ("send", "all_gather", "all_reduce")


def _key(policy: Policy, tp: Transport, max_sms: int) -> tuple:
    return (tp.name, tp.world, str(tp.device.type), policy.link_gbps, policy.latency_us, policy.codec_gbps,
            policy.margin, max_sms)


def cached_digest(policy: Policy, tp: Transport, group, max_sms: int) -> int:
    """A hash of this rank's cached calibration for the group (0: none),
    so the constructor reuses a cache only where every rank holds the same one."""
    hit = _CACHE.get(group, {}).get(_key(policy, tp, max_sms))
    return 0 if hit is None else (zlib.crc32(repr(hit).encode()) | 1)


def calibrate(policy: Policy, tp: Transport, group, timeout: float, cache_group, cached: bool,
              swap: Callable[[List[float]], list], torch_native: bool, all_gpu: bool, max_sms: int,
              one_way: bool = False) -> Calibration:
    """Measure (or, where every rank has it cached, reuse) the constants, and
    agree on them: each rank's policy ends with the same figures and margin.
    Collective: every rank calls it with the same `cached` (the constructor's
    handshake agrees on it). Each measurement's waits share one deadline of
    timeout seconds. Figures are cached per cache_group (the caller's group:
    each Communicator measures over its own private copy of it).
    swap(values): every rank's list of floats, over the Communicator's
    transport. torch_native: the group has torch collectives to measure.
    all_gpu: every rank moves GPU tensors. max_sms: the SM budget the codec
    will run under (0: all), so it is measured as it will run. one_way: every
    pair is on the transport (no torch collectives, one rank a domain), so a
    point-to-point send is timed one way, as it runs, not as half a ring
    exchange (both directions at once share the hosts' copies and cores)."""
    key = _key(policy, tp, max_sms)
    if cached:
        policy.cal, policy.margin = _CACHE[cache_group][key]
        return policy.cal
    alpha, beta = measure_link(tp, Deadline(timeout), all_gpu)
    w1 = max(tp.world - 1, 1)
    if torch_native:
        native = {op: measure_native(op, tp, group, Deadline(timeout)) for op in NATIVE_MEASURED}
    else:  # no torch collective to fall back to: "native" is a raw exchange over the same transport
        native = {"send": (alpha, beta), "all_gather": (w1 * alpha, w1 * beta),
                  "all_reduce": (2 * w1 * alpha, 2 * w1 * beta / max(tp.world, 1))}
        if one_way:
            native["send"] = measure_one_way(tp, Deadline(timeout), all_gpu)
    if policy.link_gbps:
        beta = 1e-9 / policy.link_gbps
        native = {"send": (native["send"][0], beta),
                  "all_gather": (native["all_gather"][0], beta * w1),
                  "all_reduce": (native["all_reduce"][0], beta * 2 * w1 / max(tp.world, 1))}
    if policy.latency_us is not None:
        alpha = policy.latency_us * 1e-6
    comp, decomp = {}, {}
    for dt in CODED:
        if policy.codec_gbps:
            comp[dt] = decomp[dt] = 1e-9 / policy.codec_gbps
        else:
            comp[dt], decomp[dt] = measure_codec(dt, tp.device, max_sms)
    # Agree on the slowest rank's figures so every rank decides alike.
    vec = ([alpha, beta] + [comp[d] for d in CODED] + [decomp[d] for d in CODED]
           + [v for op in NATIVE_MEASURED for v in native[op]] + [policy.margin])
    rows = swap(vec)
    v = [max(col) for col in zip(*rows)]
    policy.margin = v[-1]
    n = len(CODED)
    source = "overridden" if (policy.link_gbps and policy.codec_gbps) else "measured"
    at = 2 + 2 * n
    policy.cal = Calibration(v[0], v[1], dict(zip(CODED, v[2:2 + n])), dict(zip(CODED, v[2 + n:at])), source,
                             {op: tuple(v[at + 2 * i: at + 2 * i + 2]) for i, op in enumerate(NATIVE_MEASURED)},
                             [(dict(zip(CODED, r[2:2 + n])), dict(zip(CODED, r[2 + n:at]))) for r in rows])
    _CACHE.setdefault(cache_group, {})[key] = (policy.cal, policy.margin)
    return policy.cal


EXCHANGE_BYTES = 1 << 20  # a rank's input to the measured exchange: FSDP's per-layer collectives are 1-4 MiB


def measure_exchange(policy: Policy, run: Callable[[], None], world: int, device: torch.device,
                     swap: Callable[[List[float]], list]) -> float:
    """Host seconds per compressed exchange on this transport, in place of
    its constant: run() is one compressed all_gather of EXCHANGE_BYTES of
    bf16 a rank; its best time of two (after a warm-up), less what the model
    predicts for it with no host term (and no native floor), is this rank's
    figure, and the slowest rank's is agreed (policy.cal.host_exchange_s,
    set only once agreed). What the runs taught the policy (the ratio, the
    observations) is dropped. Collective."""
    ratio = dict(policy.ratio)
    run()  # warm-up
    best = _best_of(run, 2, device)
    probe = Policy(costs=policy.costs)
    probe.ratio = ratio
    nb = policy.cal.native.get("all_gather", (0.0, 0.0))[1]
    probe.cal = dataclasses.replace(policy.cal, host_exchange_s=0.0, native={**policy.cal.native, "all_gather": (0.0, nb)})
    mine = max(best - probe.predict("all_gather", torch.bfloat16, EXCHANGE_BYTES, world)[1], 0.0)
    agreed = max(row[0] for row in swap([mine]))
    policy.ratio = ratio
    policy.forget()
    policy.cal.host_exchange_s = agreed
    return agreed


def measure_link(tp: Transport, deadline: Deadline, all_gpu: bool):
    if tp.world == 1:
        return 0.0, 0.0
    # Sizes every rank agrees on (a mixed cluster's CPU ranks set them for all).
    small, big = (64 << 10, 16 << 20) if all_gpu else (16 << 10, 2 << 20)
    nxt, prv = (tp.rank + 1) % tp.world, (tp.rank - 1) % tp.world

    def ring(size):
        a = torch.empty(size, dtype=torch.uint8, device=tp.device)
        b = torch.empty(size, dtype=torch.uint8, device=tp.device)
        return lambda: tp.wait(tp.post([(SEND, a, nxt), (RECV, b, prv)]), deadline)

    return _alpha_beta(ring, small, big, tp.device)


def measure_one_way(tp: Transport, deadline: Deadline, all_gpu: bool):
    """(alpha, beta) of a send one way: every hop i -> i + 1 of the ring,
    timed in phases in which each rank takes part in one hop at most (the
    even hops, the odd ones, and with an odd world the wrap alone). Each
    rank's figure is its slowest phase's, so the agreed one is the slowest
    hop's, as the ring's is (a host's own pairs never stand for the links
    between hosts). After each timed transfer the receiver answers with one
    byte, untimed, so no rep's data is already in flight when it starts."""
    w = tp.world
    if w == 1:
        return 0.0, 0.0
    small, big = (256 << 10, 32 << 20) if all_gpu else (16 << 10, 2 << 20)  # every rank's alike
    me, nxt, prv = tp.rank, (tp.rank + 1) % w, (tp.rank - 1) % w
    word = torch.empty(1, dtype=torch.uint8, device=tp.device)

    def phase(i: int) -> int:  # of hop i -> i + 1
        return 2 if w % 2 and i == w - 1 else i % 2

    out = (0.0, 0.0)
    for ph in range(3 if w % 2 else 2):
        if ph not in (phase(me), phase(prv)):
            continue  # no hop of this rank's: its peers' transfers pair among themselves
        sending = phase(me) == ph  # else receiving from prv (one op a phase: the two phases differ)
        answer = [(RECV, word, nxt)] if sending else [(SEND, word, prv)]
        times = {}
        for size in (small, big):
            buf = torch.empty(size, dtype=torch.uint8, device=tp.device)
            move = [(SEND, buf, nxt)] if sending else [(RECV, buf, prv)]
            times[size] = _best_of(lambda: tp.wait(tp.post(move), deadline), 3, tp.device,
                                   between=lambda: tp.wait(tp.post(answer), deadline))
        alpha, beta = _fit(times, small, big)
        out = (max(out[0], alpha), max(out[1], beta))
    return out


def measure_native(op: str, tp: Transport, group, deadline: Deadline):
    """(alpha, beta per input byte) of torch.distributed's own collective."""
    if tp.world == 1:
        return 0.0, 0.0
    small, big = (256 << 10, 32 << 20) if tp.device.type == "cuda" else (16 << 10, 2 << 20)

    def collective(size):
        t = torch.zeros(size // 2, dtype=torch.bfloat16, device=tp.device)
        if op == "send":  # one way, in pairs (0 -> 1, 2 -> 3, ...): what a p2p send sees
            peer = tp.rank ^ 1
            if peer >= tp.world:
                return lambda: None
            kind = SEND if tp.rank % 2 == 0 else RECV
            return lambda: tp.wait(tp.post([(kind, t, peer)]), deadline)
        out = torch.empty(tp.world * t.numel(), dtype=t.dtype, device=tp.device)
        if op == "all_gather":
            def run():
                tp.wait([group.all_gather(out, t)], deadline)
        else:
            def run():
                tp.wait([group.all_reduce(t, dist.ReduceOp.SUM)], deadline)
        run()  # warm-up
        return run

    return _alpha_beta(collective, small, big, tp.device)


def measure_codec(dtype: torch.dtype, device: torch.device, max_sms: int = 0):
    # One pipeline piece's worth on GPU: the cost a transfer pays per piece.
    nbytes = (64 << 20) if device.type == "cuda" else (1 << 20)
    n = nbytes // torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator(device="cpu").manual_seed(0)
    t = (torch.randn(n, generator=g) * 0.02).to(dtype).to(device)
    sms = max_sms or None  # decompress's spelling of "every SM" (this thread's budget is already in max_sms)
    buf = codec.compress_padded(t, max_sms=max_sms)  # warm-up (and module load on GPU)
    out = torch.empty_like(t)
    codec.decompress(buf, out=out, check=True, max_sms=sms)
    best_c = best_d = float("inf")
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        buf = codec.compress_padded(t, max_sms=max_sms)
        _sync(device)
        t1 = time.perf_counter()
        codec.decompress(buf, out=out, check=True, max_sms=sms)
        _sync(device)
        t2 = time.perf_counter()
        best_c, best_d = min(best_c, t1 - t0), min(best_d, t2 - t1)
    return best_c / nbytes, best_d / nbytes


def _alpha_beta(make_run, small: int, big: int, device: torch.device):
    """(alpha, beta) fitted to the best of 3 timed runs of make_run(size)() at two sizes."""
    return _fit({size: _best_of(make_run(size), 3, device) for size in (small, big)}, small, big)


def _fit(times: dict, small: int, big: int):
    """(alpha, beta) through the times at two sizes (beta > 0, alpha >= 0)."""
    beta = max((times[big] - times[small]) / (big - small), 1e-13)
    return max(times[small] - small * beta, 0.0), beta


def _best_of(run: Callable[[], None], reps: int, device: torch.device,
             between: Optional[Callable[[], None]] = None) -> float:
    """The least seconds of reps timed calls of run(), the device drained around each; between(),
    if given, runs untimed after each."""
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        if between is not None:
            between()
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
