"""The "pz" torch.distributed backend, registered when portable_zip is
imported (and, where torch loads "torch.backends" entry points, when torch
is: see portable_zip_autoload). One line switches a program over:

    dist.init_process_group("pz")                  # every device kind
    dist.init_process_group("cpu:gloo,cuda:pz")    # GPU tensors only

docs/DROPIN.md says which ops compress and which are forwarded."""
from __future__ import annotations

import torch.distributed as dist

from .options import Options
from .process_group import KINDS, ProcessGroupPZ, make
from .report import stats
from .torch_work import TorchWork

NAME = "pz"


def _create(dist_opts, options):
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"the pz backend's pg_options must be portable_zip.c10d.Options, got {type(options).__name__}")
    if options is None and dist.is_initialized():
        # A group made without options (new_group, DeviceMesh's) takes the default group's.
        default = dist.distributed_c10d._get_default_group()
        options = default.options if isinstance(default, ProcessGroupPZ) else None
    ranks = list(dist_opts.global_ranks_in_group) or list(range(dist_opts.group_size))
    return make(dist_opts.store, dist_opts.group_rank, ranks, dist_opts.timeout.total_seconds(),
                          str(dist_opts.group_id), options)


def register() -> None:
    """Backend.register_backend("pz", ...) once per process."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=list(KINDS))


register()

__all__ = ["NAME", "Options", "ProcessGroupPZ", "TorchWork", "register", "stats"]
