"""Forwarded GPU ops where this process has no NCCL to forward them to
(ranks sharing one GPU, transport="fabric"): through host memory over the
inner gloo group, finished before the call returns."""
from __future__ import annotations

import torch

from . import torch_work


def _map(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return [_map(v, fn) for v in x]
    return x


def staged(pg, name: str, args):
    """pg.name(*args) on host copies of args' tensors, then every GPU tensor
    gets its host copy's bytes back (inputs come back unchanged)."""
    pairs = []

    def to_host(t):
        h = t.detach().to("cpu", copy=True) if t.is_cuda else t
        pairs.append((t, h))
        return h
    host_args = [_map(a, to_host) for a in args]
    getattr(pg, name)(*host_args).wait()
    for t, h in pairs:
        if t is not h:
            t.copy_(h)
    return torch_work.done([t for t, _ in pairs])
