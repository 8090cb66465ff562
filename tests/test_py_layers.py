"""ci/py_layers.py (run by ci/lint_rules): the package as it stands passes,
and each kind of violation planted in a copy of it is named."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANTS = {
    "up": ("codec/delta.py", "from ..comm import PeerError\n", "codec (floor 1) imports comm (floor 2)"),
    "inside": ("kv/sender.py", "from ..comm.p2p import PointToPoint\n", "use portable_zip.comm's face"),
    "private": ("weights/wire.py", "from ..codec import _threads\n", "codec's private name _threads"),
    "attribute": ("comm/p2p.py", "X = codec._workspace\n", "reaches codec's private name _workspace"),
    "sideways": ("ddp.py", "from .fsdp import AllGather\n", "ddp (floor 4) imports fsdp (floor 4)"),
}


def layers(pkg):
    return subprocess.run([sys.executable, os.path.join(ROOT, "ci", "py_layers.py"), pkg], capture_output=True,
                          text=True)


def test_the_package_keeps_its_layers():
    r = layers(os.path.join(ROOT, "portable_zip"))
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_a_planted_violation_is_named(kind, tmp_path):
    pkg = tmp_path / "portable_zip"
    shutil.copytree(os.path.join(ROOT, "portable_zip"), pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    rel, line, says = PLANTS[kind]
    with open(pkg / rel, "a") as f:
        f.write(line)
    r = layers(str(pkg))
    assert r.returncode == 1 and says in r.stdout, r.stdout


def test_the_comm_floor_table_is_the_codes():
    """docs/COMM.md's floor table lists every comm/ module on the floor its imports give it."""
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    import py_layers
    floors = py_layers.floors(pathlib.Path(ROOT, "portable_zip", "comm"))
    want = {f"{m.replace('.', '/')}.py": f for m, f in floors.items()}
    text = open(os.path.join(ROOT, "docs", "COMM.md")).read()
    table = text[text.index("## Layout: `portable_zip/comm/` in floors"):]
    table = table[:table.index("\n\n", table.index("| Floor |"))]
    rows = [r.split("|") for r in table.splitlines() if r.startswith("| ") and r[2].isdigit()]
    got = {r[2].strip().strip("`"): int(r[1]) for r in rows}
    assert got == want
