"""Construction: which tensors a rank moves, its private group, its domains
and the transport that connects them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.distributed as dist

from .settings import Settings
from . import address
from . import domains as dom
from .deadline import Deadline
from .group import Group
from .liveness import Liveness, Watched
from .transports import fabric
from .transports.base import Transport
from .transports.routed import RoutedTransport
from .transports.torch import TorchDistTransport


@dataclass
class Layout:
    """What construction decided."""
    tp: Transport
    domains: List[List[int]]
    domain_of: Dict[int, int]
    native: bool     # one domain over torch.distributed: torch's own collectives exist
    mixed: bool      # several domains, some of several ranks: pairs differ (native inside, fabric between)
    hier: bool       # equal domains of 2+ ranks: hierarchical all_reduce
    all_gpu: bool
    backend: str     # for people: what moves the bytes


def timeout_of(timeout, settings: Settings) -> float:
    what = "timeout"
    if timeout is None:  # PZ_TIMEOUT, read as the argument would be
        timeout = 300.0 if settings.timeout is None else settings.timeout
        what = "timeout" if settings.timeout is None else "timeout (from PZ_TIMEOUT)"
    try:
        out = float(timeout)
    except (TypeError, ValueError):
        err = TypeError if what == "timeout" else ValueError  # a variable's text is a bad value, not a bad type
        raise err(f"{what} must be a number of seconds, got {timeout!r}") from None
    if not 0 < out < math.inf:
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {timeout!r}")
    return out


def device_of(device, group: Group) -> torch.device:
    """The tensors this rank moves: device=, else the group backend's (nccl: the current GPU)."""
    if device is not None:
        d = torch.device(device)
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        if d.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be a CUDA/ROCm GPU or the CPU, got {device!r}")
        return d
    if group.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_for(group, device: torch.device, timeout) -> object:
    """What a hook's Communicator is made over: group itself where the
    backend a Communicator over it runs on moves device's tensors, else a
    group of its ranks on the backend that does (gloo for the CPU, NCCL for
    GPUs). A pz group on a machine with a GPU runs NCCL, and a CPU model
    there must not (two ranks on one GPU: "Duplicate GPU detected")."""
    want = "nccl" if device.type == "cuda" else "gloo"
    runs = str(dist.get_backend(group))
    if runs not in ("gloo", "nccl") and hasattr(group, "inner_backend"):
        runs = group.inner_backend()  # as Group.of picks for a pz group
    if runs == want:
        return group
    return Group.of(group, timeout_of(timeout, Settings.from_env()), backend=want)


def private_group(parent, timeout: float) -> Group:
    """A new group of parent's ranks (a torch group, or the pz backend's
    Group): ops queued on our worker never share tags or sequence numbers
    with the caller's own ops on theirs."""
    if not isinstance(parent, Group) and not dist.is_initialized():
        raise RuntimeError("pz.Communicator needs torch.distributed.init_process_group() first")
    return Group.of(parent, timeout)


def open_transport(group: Group, device: torch.device, transport: str, domains, settings: Settings,
                   timeout: float) -> Layout:
    """One domain: torch.distributed, as ever. Several (mixed vendors, or
    transport='fabric'): the fabric engine between them, each domain's
    native backend inside."""
    rank, world = group.rank, group.size
    mine = address.candidate(settings, group.store)
    facts = dom.rank_facts(group, device, Deadline(timeout), domains, mine)
    dom.check_facts(facts)
    all_gpu = all(f["kind"] != "cpu" for f in facts)
    doms = dom.resolve(domains, facts, transport)
    if len(doms) == 1 and transport == "fabric" and world > 1:
        doms = [[r] for r in range(world)]  # domains=[every rank]: still asked for the fabric; all of it rides there
    domain_of = {r: i for i, d in enumerate(doms) for r in d}
    if len(doms) == 1:
        if len({f["kind"] for f in facts}) > 1:
            raise ValueError("ranks hold different device kinds (" + ", ".join(
                f"rank {j} {f['kind']}" for j, f in enumerate(facts)) + "): torch.distributed cannot connect "
                "them; use transport='auto' or 'fabric'")
        tp = TorchDistTransport(group)
        if device != tp.device:
            raise ValueError(f"device={device} but group backend '{tp.backend}' moves {tp.device.type} tensors")
        tp.watch = _watch(tp, group, facts, settings, timeout, _listen(mine, facts, rank))
        if tp.backend == "nccl":
            lib = "RCCL" if torch.version.hip else "NCCL"
            why = f"group backend 'nccl' on {'ROCm' if torch.version.hip else 'CUDA'} torch: {lib}, GPU tensors"
        else:
            lib, why = tp.backend, f"group backend '{tp.backend}': CPU tensors"
        return Layout(tp, doms, domain_of, True, False, False, all_gpu, f"{lib} via {tp.name} ({why})")
    if transport == "torch":
        raise ValueError(f"domains {doms} need the fabric transport between them; use transport='auto' or 'fabric'")
    why = fabric.unavailable()
    if why:
        raise RuntimeError(f"ranks form {len(doms)} domains {doms} (device kinds: " +
                           ", ".join(sorted({f['kind'] for f in facts})) + "), which only the fabric transport "
                           f"connects, and it is unavailable: {why}")
    same_host = len({f["host"] for f in facts}) == 1
    listen = _listen(mine, facts, rank)
    fab = fabric.FabricTransport(group, device, settings, same_host, listen.ip)
    watched = Watched(fab, _watch(fab, group, facts, settings, timeout, listen))
    mixed = any(len(d) > 1 for d in doms)
    tp: Transport = watched
    if mixed:
        mine = doms[domain_of[rank]]
        near = TorchDistTransport(dom.domain_group(group, mine, facts[rank]["kind"])) if len(mine) > 1 else None
        if near is not None:
            near.watch = watched.watch  # checked in its waits; closed by whichever closes first
        tp = RoutedTransport(near, mine, watched)
    # Hierarchical reductions need equal domains (one shard per local rank).
    hier = len({len(d) for d in doms}) == 1 and len(doms[0]) > 1
    backend = f"{tp.name} ({fab.info['rails']} rails, {fab.info['chunk']}-byte chunks; domains {doms})"
    return Layout(tp, doms, domain_of, False, mixed, hier, all_gpu, backend)


@dataclass
class Channel:
    """Point to point's own transports, (to higher ranks, to lower ranks), and the groups they run on."""
    tps: tuple
    groups: list

    def close(self) -> None:
        """Each transport, then each group (a fabric transport leaves its group's sockets open), even if one fails."""
        try:
            for tp in dict.fromkeys(self.tps):
                tp.close()
        finally:
            for g in self.groups:
                g.close()


def open_channel(parent, device: torch.device, transport: str, domains, settings: Settings,
                 timeout: float) -> Channel:
    """Point to point's transports, of the same kind as the Communicator's, on
    a private group of their own, so their FIFOs hold only point-to-point
    frames. NCCL runs a pair's two directions on one stream in posting
    order, so there each direction gets a group."""
    group = private_group(parent, timeout)
    try:
        tp = open_transport(group, device, transport, domains, settings, timeout).tp
    except BaseException:
        group.close()
        raise
    if tp.backend != "nccl":
        return Channel((tp, tp), [group])
    try:
        down = TorchDistTransport(private_group(parent, timeout))
    except BaseException:
        Channel((tp,), [group]).close()
        raise
    down.watch = tp.watch  # checked in its waits; closed by whichever closes first
    return Channel((tp, down), [group, down.group])


def _listen(mine: address.Listen, facts, rank: int) -> address.Listen:
    return address.choose(mine, [f["host"] for f in facts], [f["addr"] for f in facts], rank)


def _watch(tp: Transport, group: Group, facts, settings: Settings, timeout: float, listen: address.Listen) -> Liveness:
    """The liveness watch of this Communicator, made once its transport is
    (collective); construction that fails closes the transport."""
    try:
        return Liveness(group, facts, settings, Deadline(timeout), listen)
    except BaseException:
        tp.close()
        raise
