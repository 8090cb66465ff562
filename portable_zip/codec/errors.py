"""Errors the codec raises, shared with the layers above (comm re-exports them)."""
import portable_zip._C as _C

FormatError = _C.FormatError  # a stream is malformed, truncated or corrupt (a ValueError)


class MismatchError(ValueError):
    """The two sides of a transfer disagree on dtype, size or format version
    (also: a delta's base is not the one its stream was coded against)."""
