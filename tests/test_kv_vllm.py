"""The vLLM KV connector (portable_zip.kv.vllm) driven by a stand-in of
vLLM's connector protocol (tests/fake_vllm_kv.py; vLLM has no CPU wheel):
one prefill instance, three decode instances, six concurrent requests, one
of them prefilled in chunks over three scheduler steps; every decode cache
holds the prefill's bytes bit for bit."""
import random

import comm_harness
import kv_workers as kw


def test_p1d3_through_the_stand_in():
    seed = random.SystemRandom().randrange(1 << 30)
    res = comm_harness.run(4, kw.vllm_flow, seed, env={"PZ_CHECK_PLANS": "1"}, deadline=90)
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, "\n".join(f"rank {r}: {s}: {v}" for r, (s, v) in bad.items())
    steps = res[0][1]
    # Chunked prefill: the 60-token prompt needs at least 3 steps of a 24-token budget shared by six requests.
    assert steps[2] >= 3 and sum(s > 1 for s in steps) >= 2, steps
    got = {i: n for r in (1, 2, 3) for i, n in res[r][1].items()}
    assert sorted(got) == list(range(6)), got
    # Each decode computed only the last prompt token and its 2 further steps (3 outputs): the rest arrived.
    assert all(n == 3 for n in got.values()), got
