"""Compressed communication: pz.Communicator mirrors torch.distributed.

The face of the comm layer: the adapters above it (c10d/, weights/, kv/,
the DDP and FSDP hooks) use these names only, and the codec's face
(MismatchError, which comm raises too, is the codec's). Beyond the
Communicator, its errors and Work, they need:
  Group, group_for      a private process group; the group a hook's Communicator runs on;
  Settings, Deadline    the PZ_* variables; one op's deadline;
  overrides, check_args, check_options, MODES   the arguments the backend and the hooks share;
  ReduceOp, REDUCIBLE, reduction, premultiplied  torch's reductions as pz runs them;
  swap_through_store, timeout_of                  the backend's construction;
  merged                stats of several Communicators;
  PointToPoint, TorchDistTransport               the backend's point to point."""
from .args import MODES, check_args
from .collectives import REDUCIBLE, ReduceOp, premultiplied, reduction
from .communicator import Communicator, check_options, overrides
from .deadline import Deadline
from .errors import PeerError, PeerTimeout
from .group import Group
from .p2p import PointToPoint
from .settings import Settings
from .setup import group_for, timeout_of
from .stats import merged
from .store import swap_through_store
from .transports.base import Transport
from .transports.torch import TorchDistTransport
from .work import Work

__all__ = ["MODES", "REDUCIBLE", "check_args", "Communicator", "Deadline", "Group", "PeerError", "PeerTimeout", "PointToPoint",
           "ReduceOp", "Settings", "TorchDistTransport", "Transport", "Work", "group_for", "merged", "overrides",
           "swap_through_store", "timeout_of", "check_options", "premultiplied", "reduction"]
