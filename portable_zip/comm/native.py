"""Shapes torch's own collectives move: all_to_all's rows, as bytes."""
from __future__ import annotations

import math

import torch


def rows(t: torch.Tensor) -> torch.Tensor:
    """t as (dim 0, everything else): the unit all_to_all splits."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def row_bytes(t: torch.Tensor) -> torch.Tensor:
    r = rows(t)
    if not t.numel():  # any stride is legal on an empty tensor; view() is not
        return torch.empty(r.shape[0], r.shape[1] * t.element_size(), dtype=torch.uint8, device=t.device)
    return r.view(torch.uint8)
