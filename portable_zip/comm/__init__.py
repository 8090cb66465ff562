"""Compressed communication: pz.Communicator mirrors torch.distributed."""
"""Compressed communication: pz.Communicator mirrors torch.distributed.

The face of the comm layer: the adapters above it (c10d/, weights/, kv/,
the DDP and FSDP hooks) use these names only. Beyond the Communicator,
its errors and Work, they need: Group (a private process group of their
own), group_for (the group a hook's Communicator runs on), Settings (the
PZ_* variables), Deadline, overrides (the policy's per-group overrides), check_args, MODES and REDUCIBLE
check_options, reduction, premultiplied (the arguments and reductions
the backend and the hooks share),
swap_through_store and timeout_of (for the backend's construction),
merged (stats), PointToPoint and TorchDistTransport (the backend's point
to point)."""
from .args import MODES, check_args
from .collectives import REDUCIBLE, ReduceOp, premultiplied, reduction
from .communicator import Communicator, check_options, overrides
from .deadline import Deadline
from .errors import MismatchError, PeerError, PeerTimeout
from .group import Group
from .store import swap_through_store
from .p2p import PointToPoint
from .settings import Settings
from .setup import group_for, timeout_of
from .stats import merged
from .transports.base import Transport
from .transports.torch import TorchDistTransport
from .work import Work

__all__ = ["MODES", "REDUCIBLE", "check_args", "Communicator", "Deadline", "Group", "MismatchError", "PeerError", "PeerTimeout", "PointToPoint",
           "ReduceOp", "Settings", "TorchDistTransport", "Transport", "Work", "group_for", "merged", "overrides",
           "swap_through_store", "timeout_of", "check_options", "premultiplied", "reduction"]
