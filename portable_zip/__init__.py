"""portable_zip: lossless exponent compression for GPU communication."""
from ._version import __version__  # noqa: F401

from .checks import check  # noqa: E402
from .codec import (  # noqa: E402
    FormatError,
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
from . import delta  # noqa: E402,F401  (pz.delta: lossless weight deltas)
from .comm import Communicator, MismatchError, PeerError, PeerTimeout, ReduceOp, Work  # noqa: E402
from . import c10d  # noqa: E402,F401  (registers the "pz" torch.distributed backend)
from . import fsdp  # noqa: E402,F401  (pz.fsdp.AllGather / ReduceScatter: FSDP2's custom collectives)
from .ddp import DDPHookState, ddp_comm_hook  # noqa: E402

__all__ = [
    "DDPHookState", "ddp_comm_hook", "fsdp", "c10d", "delta",
    "Communicator", "MismatchError", "PeerError", "PeerTimeout", "ReduceOp", "Work", "FormatError", "backend_info", "check", "compress", "compress_batch", "compressed_size", "decompress",
    "decompress_batch", "inspect", "max_compressed_size", "sm_budget", "trim",
]
