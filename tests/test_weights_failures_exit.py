"""No abort at exit after a refused weight-sync round (issue 36, item 4):
fresh interpreters (bench/weights_exit_loop.py) run a good round, a round
every rank refuses with MismatchError, close their Communicator and exit
the ordinary way; every rank must exit 0, with no "terminate called without
an active exception". On the tree before the torch transport's waiter
thread let go of its Works before a wait returned, about half such runs
aborted (10 of 20 at 2 ranks). PZ_TEST_EXIT_RUNS sets the runs per case
(default 3; 50 for the issue's count)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import weights_exit_loop  # noqa: E402

RUNS = int(os.environ.get("PZ_TEST_EXIT_RUNS", "3"))


@pytest.mark.parametrize("world,case", [(2, "dtype"), (3, "overlap")])
def test_no_abort_at_exit_after_a_refused_round(world, case):
    res = weights_exit_loop.loop(RUNS, world, case, close=True)
    assert res["clean"] == RUNS, res


@pytest.mark.parametrize("case", ["dtype", "native"])
def test_no_abort_at_exit_with_the_communicator_left_open(case):
    """No close(), under auto: the last ops are native gloo all_gathers of
    temporaries (the engine's own, or three bare ones). Before the torch
    transport held its latest collectives' works past their wait, gloo's
    worker dropped the last one as Python exited and aborted (weight sync:
    1 in 20-30 runs here; bare: 2 in 30)."""
    res = weights_exit_loop.loop(RUNS, 2, case, close=False, compress="auto")
    assert res["clean"] == RUNS, res
