"""From a source checkout's root, where the README sends a reader, Python
finds the checkout's portable_zip folder first, and it has no compiled
extension: the installed build of the same version serves instead, so the
README's commands work there and `import torch` registers "pz". Where that
cannot be (here: a checkout of another version), `import portable_zip`
says why and how to fix it in one error, and `import torch` warns once.
Each runs in a checkout-like folder: this checkout's two packages, copied
without anything built."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import portable_zip

SOURCE = pathlib.Path(__file__).resolve().parents[1]
NOT_REGISTERED = "the 'pz' torch.distributed backend is not registered"
REGISTERED = "import sys, torch.distributed as d; print('pz' in d.Backend.backend_list, 'portable_zip' in sys.modules)"


def checkout(root: pathlib.Path, version: str = portable_zip.__version__) -> pathlib.Path:
    skip = shutil.ignore_patterns("__pycache__", "_C*", "device")
    for pkg in ("portable_zip", "portable_zip_autoload"):
        shutil.copytree(SOURCE / pkg, root / pkg, ignore=skip)
    (root / "portable_zip" / "_version.py").write_text(f'__version__ = "{version}"\n')
    return root


def python(cwd, *args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


@pytest.fixture
def root(tmp_path):
    return checkout(tmp_path)


def test_the_checkout_folder_comes_first(root):
    out = python(root, "-c", "import importlib.util as u; print(u.find_spec('portable_zip').origin)")
    assert out.stdout.strip() == str(root / "portable_zip" / "__init__.py"), out  # what the tests below are about


def test_readme_weights_command(root):
    out = python(root, "-m", "portable_zip.weights", timeout=300)
    assert out.returncode == 0, out
    assert "step 0:" in out.stdout and "receiver matches the sender bit for bit" in out.stdout, out.stdout


def test_readme_package_commands(root):
    out = python(root, "-m", "portable_zip", "demo", "--help")
    assert out.returncode == 0 and "--layers" in out.stdout and not out.stderr, out
    out = python(root, "-c", "import portable_zip as pz, torch; "
                             "print(pz.__file__, bool(pz.inspect(pz.compress(torch.ones(64)))))")
    assert out.returncode == 0, out
    assert out.stdout.split() == [portable_zip.__file__, "True"], out  # the installed package, whole


def test_import_torch_registers_pz(root):
    out = python(root, "-c", REGISTERED)
    assert out.stdout.split() == ["True", "True"] and NOT_REGISTERED not in out.stderr, out


def test_another_version_says_why_and_import_torch_warns_once(tmp_path):
    root = checkout(tmp_path, "0.0.1+other")
    out = python(root, "-c", "import portable_zip")
    assert out.returncode != 0, out
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: portable_zip: ") and str(root / "portable_zip") in last, out.stderr
    assert f"version {portable_zip.__version__}, this folder's 0.0.1+other" in last, last
    assert "pip install ." in last and "python -P" in last, last  # how to fix it
    out = python(root, "-c", REGISTERED)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out
    assert out.stderr.count(NOT_REGISTERED) == 1 and out.stderr.count("RuntimeWarning") == 1, out.stderr
    assert "0.0.1+other" in out.stderr and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in out.stderr, out.stderr
