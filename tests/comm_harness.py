"""Run a function on N local processes with a hard deadline (gloo by default)."""
from harness.ranks import run_ranks


def run(world: int, fn, *args, deadline: float = 240.0, backend: str = "gloo", env=None) -> dict:
    """{rank: ("ok", value) | ("error", text) | ("hung", "")}. env: extra variables for the ranks."""
    return run_ranks(world, fn, *args, env={"OMP_NUM_THREADS": "1", **(env or {})}, backend=backend,
                     deadline=deadline, pg_timeout=120.0)
