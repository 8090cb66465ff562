"""Errors raised by the communicator."""


class PeerError(RuntimeError):
    """A peer failed: its connection closed, or it sent something unusable."""


class PeerTimeout(PeerError, TimeoutError):
    """A peer did not answer within the communicator's timeout (dead or hung)."""


class MismatchError(ValueError):
    """The two sides of a transfer disagree on dtype, size or format version."""
