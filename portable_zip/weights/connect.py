"""A Communicator between a trainer and inference workers that share no
torch.distributed world: a TCPStore at (address, port), hosted by rank 0,
and a gloo or NCCL group built straight from it (comm.group.Group), so
neither side's own process groups are touched."""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from ..comm import Communicator, Group


def free_port(address: str = "") -> int:
    """A TCP port free now on this host (for rank 0's store)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def host_address() -> str:
    """This host's address as peers would reach it (best effort: the outbound interface's)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def communicator(address: str, port: int, rank: int, world_size: int, *, device=None, timeout: float = 300.0,
                 compress: str = "auto", transport: str = "auto", max_sms=None, name: str = "pz-weights"):
    """Rank `rank` of a new world_size-rank Communicator whose store rank 0
    hosts at (address, port). Every rank calls it; device: "cuda" (NCCL) or
    "cpu" (gloo), default cuda when available."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    store = dist.TCPStore(address, int(port), world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    group = Group(store, rank, list(range(world_size)), "nccl" if dev.type == "cuda" else "gloo", timeout, name)
    try:
        return Communicator(group=group, compress=compress, transport=transport, timeout=timeout, max_sms=max_sms)
    except BaseException:
        group.close()
        raise


def close(comm) -> None:
    """Close a Communicator made by communicator() and the group under it."""
    try:
        comm.close()
    finally:
        if isinstance(comm.parent_group, Group):
            comm.parent_group.close()
