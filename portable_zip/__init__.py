"""portable_zip: lossless exponent compression for GPU communication."""
import importlib.util as _util
import sys as _sys

from ._version import __version__  # noqa: F401


def _installed_instead():
    """The installed portable_zip of this version, imported in this package's
    place. Python puts the current folder first on sys.path, so from a source
    checkout's root `portable_zip` is the checkout's folder, which has no
    compiled extension (it lives in the installed build). The whole installed
    package serves, its Python with its own extension: they always match."""
    import glob
    import importlib.metadata as md
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    fix = ("build and install it (`bash ci/demo`, or `pip install .`), or run Python from another folder "
           "(`python -P` keeps the current folder off sys.path)")
    try:
        dist = md.distribution(__name__)
        home = os.path.abspath(str(dist.locate_file(__name__)))
    except md.PackageNotFoundError:
        dist, home = None, ""
    if dist is None or home == here or not os.path.isfile(os.path.join(home, "__init__.py")):
        why = f"no portable_zip is installed for {_sys.executable}"
    elif dist.version != __version__:
        why = f"the installed one ({home}) is version {dist.version}, this folder's {__version__}"
    elif not glob.glob(os.path.join(home, "_C*")):
        why = f"the installed one ({home}) has no compiled extension either"
    else:
        spec = _util.spec_from_file_location(__name__, os.path.join(home, "__init__.py"),
                                             submodule_search_locations=[home])
        mod = _util.module_from_spec(spec)
        for name in [n for n in _sys.modules if n.startswith(__name__ + ".")]:
            del _sys.modules[name]  # ours (_version): the installed package imports its own
        _sys.modules[__name__] = mod  # the import system returns what sys.modules holds once this file ends
        spec.loader.exec_module(mod)
        return mod
    raise ImportError(f"portable_zip: {here} is a source checkout's package without its compiled extension "
                      f"(_C), and {why}: {fix}", name=__name__)


if _util.find_spec(__name__ + "._C") is None:
    _installed_instead()  # the imports below then bind the installed package's modules: nothing runs twice

from .codec import (  # noqa: E402
    FormatError,
    check,
    backend_info,
    compress,
    compress_batch,
    compressed_size,
    decompress,
    decompress_batch,
    inspect,
    max_compressed_size,
    sm_budget,
    trim,
)
from . import ops  # noqa: E402,F401  (registers torch.ops.portable_zip.*)
from .codec import delta  # noqa: E402,F401  (pz.delta: lossless weight deltas)
from .codec import MismatchError  # noqa: E402
from .comm import Communicator, PeerError, PeerTimeout, ReduceOp, Work  # noqa: E402
from . import c10d  # noqa: E402,F401  (registers the "pz" torch.distributed backend)
from .c10d import stats  # noqa: E402  (what the pz backend moved, per group and op)
from . import fsdp  # noqa: E402,F401  (pz.fsdp.AllGather / ReduceScatter: FSDP2's custom collectives)
from .ddp import DDPHookState, ddp_comm_hook  # noqa: E402

__all__ = [
    "DDPHookState", "ddp_comm_hook", "fsdp", "c10d", "delta", "stats",
    "Communicator", "MismatchError", "PeerError", "PeerTimeout", "ReduceOp", "Work", "FormatError", "backend_info", "check", "compress", "compress_batch", "compressed_size", "decompress",
    "decompress_batch", "inspect", "max_compressed_size", "sm_budget", "trim",
]
