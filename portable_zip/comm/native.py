"""torch.distributed's own collectives, by the names the Communicator and
the hierarchical algorithms call (uint8 views where an op only moves bytes)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rows(t: torch.Tensor) -> torch.Tensor:
    """t as (dim 0, everything else): the unit all_to_all splits."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def row_bytes(t: torch.Tensor) -> torch.Tensor:
    r = rows(t)
    if not t.numel():  # any stride is legal on an empty tensor; view() is not
        return torch.empty(r.shape[0], r.shape[1] * t.element_size(), dtype=torch.uint8, device=t.device)
    return r.view(torch.uint8)
