"""The arguments a Communicator, the pz backend's Options and the hooks
share, checked in one place so all three say the same thing."""
from __future__ import annotations

import numbers
from typing import Optional

MODES = ("auto", "always", "never")  # order: the handshake sends a mode as its index
TRANSPORTS = ("auto", "torch", "fabric")


def check_args(compress: str, transport: str = "auto", max_sms: Optional[int] = None, who: str = "") -> None:
    """ValueError naming the first bad one; who prefixes the names ("Options.")."""
    if compress not in MODES:
        raise ValueError(f"{who}compress must be 'auto', 'always' or 'never', got {compress!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"{who}transport must be 'auto', 'torch' (torch.distributed) or 'fabric' (libfabric), "
                         f"got {transport!r}")
    if max_sms is not None and (isinstance(max_sms, bool) or not isinstance(max_sms, numbers.Integral)
                                or max_sms < 1):
        raise ValueError(f"{who}max_sms must be a positive int or None, got {max_sms!r}")
