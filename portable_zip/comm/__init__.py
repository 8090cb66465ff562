"""Compressed communication: pz.Communicator mirrors torch.distributed."""
from .collectives import ReduceOp
from .communicator import Communicator, Work
from .errors import MismatchError, PeerError, PeerTimeout
from .transport import TorchDistTransport, Transport

__all__ = ["Communicator", "MismatchError", "PeerError", "PeerTimeout", "ReduceOp", "TorchDistTransport",
           "Transport", "Work"]
