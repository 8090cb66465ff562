"""ci/test prints a line at least every minute while it builds the wheel and
waits for the source builds and the fuzzer (which log to files): its heartbeat,
run here from ci/test's own text with the minute made short, prints while
a step runs, stops with the step, keeps a failed step's exit status and
leaves no process behind."""
import pathlib
import re
import subprocess
import time

CI_TEST = pathlib.Path(__file__).resolve().parents[1] / "ci" / "test"
LINE = re.compile(r"^== ci/test: still (.+) \((\d+) min\)$")


def heartbeat_code(period: str) -> str:
    """ci/test's heartbeat functions and its EXIT trap, sleeping `period` instead of a minute."""
    text = CI_TEST.read_text()
    m = re.search(r"^heartbeat\(\) \{.*?^trap heartbeat_stop EXIT$", text, re.S | re.M)
    assert m, "ci/test defines no heartbeat"
    assert "sleep 60 &" in m.group(0), "the heartbeat's period is not a minute"
    return m.group(0).replace("sleep 60 &", f"sleep {period} &")


def bash(body: str, period: str = "0.2", timeout: float = 20) -> subprocess.CompletedProcess:
    # capture_output: run() returns only once every process holding the pipe has exited
    return subprocess.run(["bash", "-c", "set -euo pipefail\n" + heartbeat_code(period) + "\n" + body],
                          capture_output=True, text=True, timeout=timeout)


def test_the_long_steps_run_under_a_heartbeat():
    """The wheel builds under a heartbeat. The source builds and the fuzzer
    run in the background beside the tests (which print as they go), each
    writing its exit status to a file as it ends; the wait for those files
    runs under a heartbeat, stopped after it, and each status is checked."""
    lines = CI_TEST.read_text().splitlines()

    def beating(at: int, what: str) -> None:
        last = [line for line in lines[:at] if re.match(r"\s*heartbeat(_stop)?\b", line)]
        assert last and last[-1].startswith("heartbeat "), f"ci/test runs {what!r} with no heartbeat on"
        assert any(line.startswith("heartbeat_stop") for line in lines[at:]), f"nothing stops {what!r}'s heartbeat"

    steps = next((line for line in lines if line.startswith("steps=(")), "")
    for step in ("bash ci/wheels", "bash ci/compile_matrix", "bash ci/fuzz", "bash ci/vendor_builds"):
        at = next(i for i, line in enumerate(lines) if step in line and not line.lstrip().startswith("#"))
        if not lines[at].split("#")[0].rstrip().endswith("&"):
            beating(at, step)
            continue
        rc = re.search(r'echo \$\? > "\$logs/(\w+)\.rc"', lines[at])
        assert rc and rc.group(1) in steps, f"the background {step!r} leaves no exit status that ci/test reads"
        poll = next((i for i, line in enumerate(lines) if '[ -e "$logs/$step.rc" ]' in line), None)
        assert poll is not None and poll > at, f"ci/test never waits for {step!r}"
        beating(poll, f"the wait for {step}")
    check = next((i for i, line in enumerate(lines) if '[ "$(cat "$logs/$step.rc"' in line), None)
    assert check is not None and "rc=1" in lines[check], "ci/test does not fail on a background step's status"


def test_beats_while_a_step_runs_and_stops_with_it():
    out = bash('heartbeat "building the wheel"; sleep 1.1; heartbeat_stop; echo stopped; sleep 0.6')
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()
    beats = [LINE.match(line) for line in lines[:lines.index("stopped")]]
    assert len(beats) >= 3 and all(beats), out.stdout
    assert [b.group(1) for b in beats] == ["building the wheel"] * len(beats)
    assert [int(b.group(2)) for b in beats] == list(range(1, len(beats) + 1))
    assert lines[-1] == "stopped", out.stdout  # no beat after the stop


def test_a_failed_step_keeps_its_status_and_leaves_nothing_behind():
    for body, rc in (("heartbeat x; false", 1), ("heartbeat x; exit 3", 3), ("heartbeat x; sleep 0.3", 0)):
        t0 = time.monotonic()
        out = bash(body, period="5")  # a leftover loop or sleep would hold the pipe open for seconds
        assert out.returncode == rc, (body, out)
        assert time.monotonic() - t0 < 3, f"{body!r}: a heartbeat process outlived the script"
