"""The command lines: `python -m portable_zip` (demo, inspect) and
`python -m portable_zip.weights` take --help, print it without running
anything, and say what every option does; inspect reads a stream's header,
and a file that is not a stream (or no file) costs one line on stderr and
a nonzero exit, not a traceback. Run from a folder outside the checkout, so
the installed package is what runs."""
import argparse
import subprocess
import sys

import pytest
import torch

import portable_zip as pz
from portable_zip import __main__ as cli
from portable_zip.weights import __main__ as weights_cli


def run(tmp_path, *args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def described(p: argparse.ArgumentParser) -> list:
    """(parser, option) pairs with no help text, through every subcommand."""
    bare = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                bare += [(f"{p.prog} {name}", o) for _, o in described(sub)]
        elif not a.help or a.help == argparse.SUPPRESS:
            bare.append((p.prog, a.option_strings or a.dest))
    return bare


@pytest.mark.parametrize("make", [cli.parser, weights_cli.parser], ids=["portable_zip", "portable_zip.weights"])
def test_every_option_says_what_it_does(make):
    assert not described(make()), described(make())


@pytest.mark.parametrize("args,words", [
    (["-m", "portable_zip", "--help"], ["demo", "inspect"]),
    (["-m", "portable_zip", "demo", "--help"], ["--layers", "transformer layers", "--hidden", "hidden size"]),
    (["-m", "portable_zip", "inspect", "--help"], ["path", "the file holding the stream"]),
    (["-m", "portable_zip.weights", "--help"], ["--steps", "weight syncs to run"]),
])
def test_help_prints_and_runs_nothing(tmp_path, args, words):
    out = run(tmp_path, *args, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage:"), out
    assert all(w in out.stdout for w in words), out.stdout
    assert "step 0" not in out.stdout and not out.stderr, out  # the weights example did not run


def test_weights_example_takes_its_steps(tmp_path):
    out = run(tmp_path, "-m", "portable_zip.weights", "--steps", "2", timeout=240)
    assert out.returncode == 0, out
    assert "step 1:" in out.stdout and "step 2:" not in out.stdout, out.stdout
    assert "receiver matches the sender bit for bit" in out.stdout, out.stdout


def test_inspect_reads_a_stream(tmp_path):
    f = tmp_path / "stream.bin"
    pz.compress(torch.randn(1000).to(torch.bfloat16)).numpy().tofile(f)
    out = run(tmp_path, "-m", "portable_zip", "inspect", str(f), timeout=60)
    assert out.returncode == 0 and not out.stderr, out
    assert "dtype: torch.bfloat16" in out.stdout and "shape: (1000,)" in out.stdout, out.stdout


@pytest.mark.parametrize("content,problem", [
    (b"hello, not a stream\n", "not a portable_zip stream"),
    (b"", "not a portable_zip stream"),
    (bytes(range(256)) * 16, "not a portable_zip stream"),
    (None, "No such file or directory"),
])
def test_inspect_on_what_is_not_a_stream_says_one_line(tmp_path, content, problem):
    f = tmp_path / "thing.bin"
    if content is not None:
        f.write_bytes(content)
    out = run(tmp_path, "-m", "portable_zip", "inspect", str(f), timeout=60)
    assert out.returncode != 0 and not out.stdout, out
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("python -m portable_zip inspect: ") and str(f) in out.stderr, out.stderr
    assert problem in out.stderr, out.stderr
