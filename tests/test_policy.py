"""The cost model on synthetic calibrations: decisions follow the numbers."""
import pytest
import torch

from portable_zip.comm.policy import Calibration, Policy

BF16 = torch.bfloat16
OPS = ["send", "broadcast", "all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


def policy(link_gbps, codec_gbps, latency_us=10.0, native=None):
    p = Policy()
    beta = 1e-9 / link_gbps
    per = 1e-9 / codec_gbps
    cal = Calibration(latency_us * 1e-6, beta, {BF16: per}, {BF16: per})
    if native:
        cal.native = native
    p.cal = cal
    return p


@pytest.mark.parametrize("op", OPS)
def test_slow_link_fast_codec_compresses_large(op):
    p = policy(link_gbps=5, codec_gbps=1000)
    assert p.choose(op, BF16, 256 << 20, 2) == "compressed"


@pytest.mark.parametrize("op", OPS)
def test_fast_link_slow_codec_stays_native(op):
    p = policy(link_gbps=360, codec_gbps=100)
    for size in (1 << 20, 64 << 20, 1 << 30):
        assert p.choose(op, BF16, size, 2) == "native"


@pytest.mark.parametrize("op", OPS)
def test_small_messages_stay_native(op):
    # Three latency rounds dominate a 4 KiB transfer.
    assert policy(link_gbps=5, codec_gbps=1000, latency_us=50).choose(op, BF16, 4096, 4) == "native"


@pytest.mark.parametrize("latency_us", [10.0, 1e3, 5e3])
def test_p2p_decision_does_not_hang_on_latency(latency_us):
    # A point-to-point message pays one latency round raw or coded (its frame
    # travels with the payload): a loaded host's slow handshake must not turn
    # a clear win into raw. 100 KB at 50 Mbit/s: 16 ms raw, ~11 ms coded.
    p = policy(link_gbps=0.05, codec_gbps=50, latency_us=latency_us)
    p.cal.native = {"send": (latency_us * 1e-6, p.cal.beta)}
    assert p.choose("send", BF16, 100_000, 3) == "compressed"
    p.cal.per_rank = [({BF16: 1e-9 / 50}, {BF16: 1e-9 / 50})] * 2
    assert p.pair_pays(BF16, 100_000, 0, 1, p2p=True)


def test_measured_native_collective_wins_over_p2p_model():
    # NCCL's all_gather measured twice as fast as p2p suggests: compression must
    # beat that, not the p2p estimate.
    p = policy(link_gbps=5, codec_gbps=60)
    size = 1 << 30
    assert p.choose("all_gather", BF16, size, 2) == "compressed"
    fast_native = {"all_gather": (1e-4, 1e-9 / 12), "all_reduce": (1e-4, 1e-9 / 12)}
    p2 = policy(link_gbps=5, codec_gbps=60, native=fast_native)
    assert p2.choose("all_gather", BF16, size, 2) == "native"


def test_uncoded_dtypes_and_single_rank_are_native():
    p = policy(link_gbps=1, codec_gbps=1000)
    assert p.choose("send", torch.int32, 1 << 30, 2) == "native"
    assert p.choose("all_reduce", BF16, 1 << 30, 1) == "native"
    assert p.choose("all_reduce", BF16, 0, 2) == "native"


def test_margin_blocks_marginal_wins():
    p = policy(link_gbps=30, codec_gbps=600)
    native, coded = p.predict("send", BF16, 1 << 30, 2)
    p.margin = 0.0
    expect = "compressed" if coded < native else "native"
    assert p.choose("send", BF16, 1 << 30, 2) == expect
    p.margin = 1.0  # no plan can be 100% faster
    assert p.choose("send", BF16, 1 << 30, 2) == "native"


def test_running_ratio_is_order_independent():
    a, b = Policy(), Policy()
    streams = [(BF16, 1000, 1300), (BF16, 3000, 4100), (torch.float16, 100, 170)]
    a.observe(streams)
    b.observe(list(reversed(streams)))
    assert a.ratio == b.ratio
    assert a.ratio[BF16] == pytest.approx(0.5 * 0.67 + 0.5 * (5400 / 8000))


def test_pair_decisions_use_both_ends_codecs():
    """Mixed clusters: a GPU pair compresses over a 3.5 GB/s fabric, a pair
    with a CPU rank (0.4 GB/s codec) does not, and both ends decide alike."""
    gpu, cpu = ({BF16: 1e-9 / 800}, {BF16: 1e-9 / 1000}), ({BF16: 1e-9 / 0.4}, {BF16: 1e-9 / 0.45})
    p = policy(link_gbps=3.5, codec_gbps=0.4)
    p.cal.per_rank = [gpu, gpu, cpu, cpu]
    n = 64 << 20
    assert p.pair_pays(BF16, n, 0, 1) and p.pair_pays(BF16, n, 1, 0)
    for i, j in ((0, 2), (2, 0), (1, 3), (2, 3)):
        assert not p.pair_pays(BF16, n, i, j)
    assert not p.pair_pays(torch.int32, n, 0, 1) and not p.pair_pays(BF16, 0, 0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_chunk_sum_shortcut_is_the_fp32_rule(dtype):
    """reduce_local's a + b shortcut must give the bytes of fp32 accumulation with one rounding."""
    from portable_zip.comm.collectives import ReduceOp, reduce_local

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    a, b = [(torch.randn(1_000_003, generator=g) * s).to(dtype) for s in (0.02, 3.0)]
    bits = torch.cat([torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)] * 2)
    for x, y in ((a, b), (bits, bits.flip(0))):  # every bit pattern, NaN and inf included
        want = (x.float() + y.float()).to(dtype)
        got = reduce_local([x, y], ReduceOp.SUM)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_slower_than_predicted_is_rejudged_alike():
    """Each rank notes its own time; the swap gives every rank every note;
    the same words give the same factor and fingerprint, and a plan the
    notes say ran 5x slower than predicted, three swaps running, goes native."""
    a, b = policy(link_gbps=5, codec_gbps=1000), policy(link_gbps=5, codec_gbps=1000)
    size = next(s for s in (1 << k for k in range(10, 31)) if a.choose("all_reduce", BF16, s, 2) == "compressed")
    coded = a.predict("all_reduce", BF16, size, 2)[1]
    for swap in range(3):
        a.note("all_reduce", BF16, size, 2, 5 * coded)  # rank 0: 5x its prediction
        b.note("all_reduce", BF16, size, 2, 0.9 * coded)
        words = [a.report(), b.report()]
        assert words[0] == 5000 and 800 < words[1] <= 900, words
        assert a.report() == 0  # each observation is reported once
        for p in (a, b):
            p.heard(words)
        if swap < 2:
            assert a.slowdown == 1.0  # not yet three running
            assert a.choose("all_reduce", BF16, size, 2) == "compressed"
    assert a.slowdown == b.slowdown == 1 + 0.5 * 4
    assert a.fingerprint(BF16) == b.fingerprint(BF16)
    assert a.choose("all_reduce", BF16, size, 2) == "native"  # the decision it cached before is re-judged


def test_one_hiccup_moves_nothing_faster_changes_nothing_and_slowness_passes():
    p = policy(link_gbps=5, codec_gbps=1000)
    fp = p.fingerprint(BF16)
    for words in ([5000], [1000, 0], [900]):  # one slow op (a GC pause), then as predicted
        p.heard(words)
    assert p.slowdown == 1.0 and p.fingerprint(BF16) == fp
    for _ in range(3):
        p.heard([300, 0])  # ran in 0.3x the prediction: the model stays as calibrated
    assert p.slowdown == 1.0
    p.heard([0, 0])  # no observation: nothing heard
    for _ in range(3):
        p.heard([9000, 100])  # the slowest rank's counts
    assert p.slowdown == 5.0
    for _ in range(3):
        p.heard([100_000])
    assert p.slowdown == 8.0  # bounded
    for _ in range(14):
        p.heard([1000])  # as predicted again
    assert p.slowdown < 1.01


def test_a_raw_plan_slower_than_predicted_moves_auto_to_compress():
    """Without torch collectives auto's alternative is the raw pipeline:
    raw ops that keep running 3x their prediction (negated words) raise
    raw_slowdown alike on every rank, and the largest size still raw turns
    compressed; compressed observations let it decay back toward 1."""
    a, b = policy(link_gbps=2, codec_gbps=8), policy(link_gbps=2, codec_gbps=8)
    sizes = [1 << k for k in range(20, 31)]
    size = max(s for s in sizes if a.choose("all_reduce", BF16, s, 2) == "native")
    assert size < sizes[-1] and size >= Policy.RAW_MIN_BYTES
    native = a.predict("all_reduce", BF16, size, 2)[0]
    fp = a.fingerprint(BF16)
    sends = [a.choose("send", BF16, s, 2) for s in sizes]
    for swap in range(3):
        a.note("all_reduce", BF16, size, 2, 3 * native, raw=True)
        b.note("all_reduce", BF16, size, 2, 2.5 * native, raw=True)
        words = [a.report(), b.report()]
        assert words[0] == -3000 and -2500 <= words[1] < -2490, words
        for p in (a, b):
            p.heard(words)
        if swap < 2:
            assert a.raw_slowdown == 1.0 and a.choose("all_reduce", BF16, size, 2) == "native"
    assert a.raw_slowdown == b.raw_slowdown == 1 + 0.5 * 2  # halfway to the least of three (the slowest rank's each)
    assert a.slowdown == 1.0 and a.fingerprint(BF16) == b.fingerprint(BF16) != fp
    assert a.choose("all_reduce", BF16, size, 2) == "compressed"
    assert [a.choose("send", BF16, s, 2) for s in sizes] == sends  # point to point: LinkSeen's, not this
    for n in range(200):  # compressed for long enough: raw is tried again
        for p in (a, b):
            p.heard([1000, 1000])
        if n == 20:
            assert 1.5 < a.raw_slowdown == b.raw_slowdown < 2 and a.raw_slowdown * 1024 == int(a.raw_slowdown * 1024)
    assert a.raw_slowdown == b.raw_slowdown == 1.0 and a.slowdown == 1.0
    assert a.choose("all_reduce", BF16, size, 2) == b.choose("all_reduce", BF16, size, 2) == "native"
    a.heard([-5000])  # one hiccup once the old observations have faded: nothing moves
    assert a.raw_slowdown == 1.0
    a.forget()
    assert a.raw_slowdown == 1.0 and a._heard_raw == []


def test_small_or_fast_raw_ops_teach_nothing():
    p = policy(link_gbps=5, codec_gbps=8)
    p.note("all_reduce", BF16, Policy.RAW_MIN_BYTES - 2, 2, 100.0, raw=True)  # mostly host work
    assert p.report() == 0
    p.note("broadcast", BF16, 64 << 20, 9, 100.0, raw=True)  # flat from the source, not the tree predicted
    assert p.report() == 0
    p.cal.host_exchange_s = 1e-3
    p.note("all_gather", BF16, 2 << 20, 2, 100.0, raw=True)  # 0.43 ms predicted: less than the host's 1 ms
    assert p.report() == 0
    p.note("all_gather", BF16, 8 << 20, 2, 100.0, raw=True)  # 1.7 ms
    assert p.report() < 0
    p.note("all_reduce", torch.int64, 8 << 20, 2, 100.0, raw=True)  # any dtype's raw op times the link
    assert p.report() < 0
    for _ in range(3):
        p.heard([-300, -200])  # raw ran faster than predicted: the model stays as calibrated
    assert p.raw_slowdown == 1.0
    for _ in range(3):
        p.heard([-100_000])
    assert p.raw_slowdown == Policy.SLOWDOWN_RANGE[1]  # bounded


def test_a_link_seen_slower_is_followed_by_the_sender_alone():
    from portable_zip.comm.observed import LinkSeen
    seen, big, run = LinkSeen(), LinkSeen.MIN_BYTES, LinkSeen.RUN
    seen.raw(1, big - 1, 10.0, lambda: 1.0)  # too small to say anything about the link
    for _ in range(run - 1):
        seen.raw(1, big, 3.0, lambda: 1.0)
    assert seen.factor(1) == 1.0  # fewer than a run's observations move nothing
    seen.raw(1, big, 40.0, lambda: 1.0)  # a stall among them: the run's median counts
    assert seen.factor(1) == pytest.approx(2.0) and seen.factor(0) == 1.0  # halfway to 3; each peer its own
    for _ in range(run):
        seen.raw(1, big, 0.5, lambda: 1.0)  # faster than calibrated: never below 1
    assert seen.factor(1) == 1.0
    for _ in range(20):
        seen.raw(1, big, 1000.0, lambda: 1.0)
    assert seen.factor(1) == LinkSeen.RANGE[1]
    seen.coded(1)
    assert seen.factor(1) == pytest.approx(1 + (LinkSeen.RANGE[1] - 1) * LinkSeen.DECAY)
    for _ in range(200):  # compressed for long enough: the link is tried raw again
        seen.coded(1)
    assert seen.factor(1) == 1.0  # within SNAP of 1 is 1: "as calibrated" again, exactly
    seen.raw(1, big, 0.0, lambda: 1.0)  # a receiver that reported no arrival time (an older peer): nothing learned
    assert seen.factor(1) < 1.01


def test_send_pays_on_a_link_slower_than_calibrated():
    p = policy(link_gbps=10, codec_gbps=40, latency_us=50)
    size = 16 << 20
    assert p.choose("send", BF16, size, 2) == "native" and not p.send_pays(BF16, size, 1.0)
    assert p.send_pays(BF16, size, 3.0)  # three decodes behind one link: each pair a third of it
    assert not p.send_pays(torch.int64, size, 64.0) and not p.send_pays(BF16, 0, 64.0)
    p.slowdown = 8.0  # compressed plans seen running slow weigh on it too
    assert not p.send_pays(BF16, size, 4.0)
    p.slowdown = 1.0
    # A stream of messages: the next one's codec work overlaps this one's wire, no pipeline fill.
    assert not p.send_pays(BF16, size, 1.5) and p.send_pays(BF16, size, 1.5, streaming=True)


def test_a_compressed_plan_is_never_faster_than_the_native_ops_own_latency():
    # torch's all_gather timed at 5 ms a call on a loaded host: the compressed
    # plan runs over the same transport, spec swap included, so a 30-byte op
    # never looks cheaper compressed (it did: two p2p rounds of 10 us).
    b = 1e-9 / 5  # the link's seconds per byte; at 3 ranks all_gather moves 2x, all_reduce 4/3x
    slow = {"send": (5e-3, b), "all_gather": (5e-3, 2 * b), "all_reduce": (5e-3, 4 * b / 3)}
    p = policy(link_gbps=5, codec_gbps=0.01, native=slow)
    for op in ("send", "all_gather", "all_reduce"):
        native, coded = p.predict(op, BF16, 30, 3)
        assert coded >= 5e-3 and p.choose(op, BF16, 30, 3) == "native", (op, native, coded)
    assert policy(link_gbps=5, codec_gbps=1000, native=slow).choose("all_gather", BF16, 256 << 20, 3) == "compressed"


def test_compressed_messages_slower_than_predicted_are_judged_per_peer_dtype_and_size():
    from portable_zip.comm.observed import CodedSeen
    seen, big, run = CodedSeen(), CodedSeen.MIN_BYTES, CodedSeen.RUN
    seen.coded(1, BF16, big - 1, 10.0, lambda: 1.0)  # too small: mostly fixed costs
    seen.coded(1, BF16, big, 0.0, lambda: 1.0)  # not timed: nothing learned
    for _ in range(run - 1):
        seen.coded(1, BF16, big, 3.0, lambda: 1.0)
    assert seen.factor(1, BF16, big) == 1.0  # fewer than a run's observations move nothing
    seen.coded(1, BF16, big, 40.0, lambda: 1.0)  # a stall among them: the run's median counts
    assert seen.factor(1, BF16, big) == pytest.approx(2.0)  # halfway to 3
    assert seen.factor(0, BF16, big) == 1.0 and seen.factor(1, BF16, 4 * big) == 1.0  # each peer, size class
    assert seen.factor(1, torch.float32, big) == 1.0  # and dtype its own
    assert seen.factor(1, BF16, big + big // 2) == pytest.approx(2.0)  # the same power of two
    seen.raw(1, torch.float32, big)  # another dtype's raw message ages nothing here
    assert seen.factor(1, BF16, big) == pytest.approx(2.0)
    seen.raw(1, BF16, big)
    assert seen.factor(1, BF16, big) == pytest.approx(1 + CodedSeen.DECAY)  # raw ages it: compression tried again
    for _ in range(40):
        seen.raw(1, BF16, big)
    assert seen.factor(1, BF16, big) == 1.0  # within SNAP of 1 is 1
    seen.coded(1, BF16, big, 1.0, lambda: 1.0)  # a retry that ran as predicted: the aged run does not undo it
    assert seen.factor(1, BF16, big) < 1.0 + CodedSeen.SNAP
    for _ in range(20):
        seen.coded(1, BF16, big, 1000.0, lambda: 1.0)
    assert seen.factor(1, BF16, big) == CodedSeen.RANGE[1]
    for _ in range(run + 12):  # halfway steps from the top
        seen.coded(1, BF16, big, 0.5, lambda: 1.0)  # faster than predicted: never below 1
    assert seen.factor(1, BF16, big) == 1.0


def test_send_pays_carries_the_coded_factor():
    p = policy(link_gbps=10, codec_gbps=40, latency_us=50)
    n = 64 << 20
    assert p.send_pays(BF16, n, 1.0)
    native, coded = p.predict("send", BF16, n, 2)
    slower = native / coded  # compressed this much slower runs as long as raw: no longer pays
    assert p.send_pays(BF16, n, 1.0, False, 0.9 * slower) and not p.send_pays(BF16, n, 1.0, False, slower)
