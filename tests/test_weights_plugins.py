"""The installed package declares the vLLM plugin hook, and the hook behaves
as a vLLM plugin must: it registers the engine once however often vLLM runs
it, and without vLLM's API it warns instead of raising (a raising plugin stops
vLLM). Each check runs in a fresh interpreter: the stand-in replaces vllm.*
in sys.modules."""
import importlib.metadata
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(code: str) -> str:
    p = subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=HERE, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))})
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def test_the_package_declares_the_vllm_plugin():
    eps = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("portable_zip_weights") == "portable_zip.weights.vllm:plugin", eps


def test_plugin_registers_once_through_the_entry_point():
    out = _run("""
import importlib.metadata, fake_vllm
fake_vllm.install()
ep = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "portable_zip_weights"][0]
hook = ep.load()
hook(); hook()   # vLLM may load plugins more than once per process
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F
cls = F._registry["portable_zip"][0]
print("registered", cls.__name__, [c.__name__ for c in cls.__mro__][:2])
""")
    assert "registered PZWeightTransferEngine" in out, out
    assert "not registered" not in out, out


def test_plugin_without_vllm_warns_and_returns():
    out = _run("""
import sys
sys.modules["vllm"] = None   # as if vLLM were absent, even where it is installed
from portable_zip.weights import vllm as pzv
pzv.plugin()
print("returned")
""")
    assert "returned" in out and "RuntimeWarning" in out and "not registered" in out, out
