"""Errors raised by the communicator (MismatchError is the codec's: its
delta codec raises it too, and an error lives in the lowest layer that raises it)."""
from ..codec import MismatchError


class PeerError(RuntimeError):
    """A peer failed: its connection closed, or it sent something unusable."""


class PeerTimeout(PeerError, TimeoutError):
    """A peer did not answer within the communicator's timeout (dead or hung)."""


__all__ = ["MismatchError", "PeerError", "PeerTimeout"]  # MismatchError: for comm's own modules
