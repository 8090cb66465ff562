"""pz.weights' planner as pure functions: which sender serves which rows,
delta vs full and why, buckets, and the mismatches it refuses. Every rank
runs these on the same manifests, so their output is the plan."""
import pytest

from portable_zip.comm.errors import MismatchError
from portable_zip.weights import plan as P


def sender(tensors, version=3, delta=True, final=True):
    return {"role": "send", "version": version, "final": final, "delta": delta, "bucket_bytes": 1 << 20,
            "tensors": [dict({"dtype": "torch.bfloat16", "base_version": None, "base_checksum": None}, **t)
                        for t in tensors]}


def receiver(wants, delta=True):
    return {"role": "recv", "delta": delta, "held": {},
            "wants": {n: dict({"dtype": "torch.bfloat16", "version": None, "checksum": None}, **w)
                      for n, w in wants.items()}}


def test_rows_come_from_the_lowest_ranked_holder():
    # rank 0 holds rows [0, 6) of w, rank 1 rows [4, 10) (overlap 4-6), rank 2 wants [2, 9)
    m = [sender([{"name": "w", "shape": [10, 4], "row0": 0, "rows": 6}]),
         sender([{"name": "w", "shape": [10, 4], "row0": 4, "rows": 6}]),
         receiver({"w": {"shape": [10, 4], "row0": 2, "rows": 7}})]
    part = P.plan_part(m, 1 << 20)
    assert [(c.src, c.g0, c.g1) for c in part.chunks] == [(0, 2, 6), (1, 6, 9)]
    assert all(c.reason == "first sync" for c in part.chunks)


def test_uncovered_rows_raise():
    m = [sender([{"name": "w", "shape": [10, 4], "row0": 0, "rows": 5}]),
         receiver({"w": {"shape": [10, 4], "row0": 3, "rows": 7}})]
    with pytest.raises(MismatchError, match=r"no sender holds rows \[5, 10\) of 'w', which rank 1 asks for"):
        P.plan_part(m, 1 << 20)


def test_delta_only_where_the_receiver_holds_the_base():
    t = {"name": "w", "shape": [8], "row0": 0, "rows": 8, "base_version": 2, "base_checksum": 77}
    m = [sender([t]),
         receiver({"w": {"shape": [8], "row0": 0, "rows": 8, "version": 2, "checksum": 77}}),
         receiver({"w": {"shape": [8], "row0": 0, "rows": 8, "version": 1, "checksum": 5}}),
         receiver({"w": {"shape": [8], "row0": 0, "rows": 8, "version": 2, "checksum": 78}}),
         receiver({"w": {"shape": [8], "row0": 0, "rows": 8, "version": 2, "checksum": 77}}, delta=False)]
    why = {c.dst: c.reason for c in P.plan_part(m, 1 << 20).chunks}
    assert why == {1: "", 2: "missed step: receiver holds version 1, sender's base is 2",
                   3: "receiver's copy differs from the base (checksum)",
                   4: "delta coding unavailable or off on the receiver"}


def test_chunks_and_buckets_respect_bucket_bytes():
    m = [sender([{"name": "a", "shape": [100, 8], "row0": 0, "rows": 100},  # 16 bytes a row
                 {"name": "b", "shape": [3], "row0": 0, "rows": 3}]),
         receiver({"a": {"shape": [100, 8], "row0": 0, "rows": 100}, "b": {"shape": [3], "row0": 0, "rows": 3}})]
    part = P.plan_part(m, 160)
    assert [(c.name, c.g0, c.g1) for c in part.chunks][:2] == [("a", 0, 10), ("a", 10, 20)]
    assert all(sum(P.chunk_bytes(part.chunks[i], part.meta) for i in b) <= 160 for b in part.buckets)
    assert sorted(i for b in part.buckets for i in b) == list(range(len(part.chunks)))


@pytest.mark.parametrize("case,pattern", [
    ("dtype", r"'w': rank 0 has torch.bfloat16\[4\] but rank 1's tensor is torch.float16\[4\]"),
    ("version", r"senders send different versions: \[3, 4\]"),
    ("roles", r"needs a sender and a receiver"),
])
def test_refused(case, pattern):
    a = sender([{"name": "w", "shape": [4], "row0": 0, "rows": 4}])
    b = sender([{"name": "w", "shape": [4], "row0": 0, "rows": 4, "dtype": "torch.float16"}]) if case == "dtype" \
        else sender([{"name": "w", "shape": [4], "row0": 0, "rows": 4}], version=4)
    m = [a, b, receiver({"w": {"shape": [4], "row0": 0, "rows": 4}})] if case != "roles" else [a, b]
    with pytest.raises(MismatchError, match=pattern):
        P.plan_part(m, 1 << 20)
