"""Errors of KV transfers: each names the request it failed."""
from ..codec import MismatchError
from ..comm import PeerError


class KVTransferError(PeerError):
    """A request's transfer failed: its peer died or went silent, it sent
    something unusable (a corrupted block, a malformed descriptor), or the
    request was aborted. request_id names it (None: the whole stream)."""

    def __init__(self, message: str, request_id=None):
        super().__init__(message)
        self.request_id = request_id


class KVIntegrityError(KVTransferError):
    """A block payload arrived whose checksum differs from the sender's: it is
    never written into the cache."""


class KVMismatchError(MismatchError):
    """The two sides of a request disagree on layers, dtype, block shape or
    block count."""

    def __init__(self, message: str, request_id=None):
        super().__init__(message)
        self.request_id = request_id
