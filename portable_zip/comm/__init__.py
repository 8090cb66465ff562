"""Compressed communication: pz.Communicator mirrors torch.distributed."""
from .collectives import ReduceOp
from .communicator import Communicator
from .errors import MismatchError, PeerError, PeerTimeout
from .p2p import PointToPoint
from .transports.base import Transport
from .transports.torch import TorchDistTransport
from .work import Work

__all__ = ["Communicator", "MismatchError", "PeerError", "PeerTimeout", "PointToPoint", "ReduceOp",
           "TorchDistTransport", "Transport", "Work"]
