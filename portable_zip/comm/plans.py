"""Which plan an op runs: "native" (torch.distributed's own op), "raw" (the
pipeline, uncompressed) or "compressed", from the mode, the op's own
arguments and the agreed policy state only, so every rank of a correct
program picks the same one (docs/COMM.md). In a mixed cluster a compressed
plan compresses only the pairs between domains that gain (coded(peer))."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List

import torch

from ..codec import CODED
from .policy import Policy

_CODED = frozenset(CODED)  # a set: membership is on every op's path


class Plans:
    def __init__(self, mode: str, policy: Policy, rank: int, world: int, domain_of: Dict[int, int],
                 native: bool, mixed: bool):
        self.mode, self.policy, self.rank, self.world = mode, policy, rank, world
        self.domain_of = domain_of
        self.native = native  # one domain over torch.distributed: torch's own collectives exist
        self.mixed = mixed    # several domains, some of several ranks: pairs differ

    def cross(self, peer: int) -> bool:
        return self.domain_of[peer] != self.domain_of[self.rank]

    def op(self, op: str, dtype: torch.dtype, nbytes: int) -> str:
        if self.mode == "never":
            return "raw"
        if dtype not in _CODED:
            return "native" if self.mode == "auto" and self.native else "raw"
        if self.mode == "always":
            return "compressed"
        if self.mixed:  # compressed when some cross-domain pair gains; coded() picks the pairs
            return "compressed" if self.policy.any_pair_pays(dtype, max(nbytes // self.world, 1)) else "raw"
        plan = self.policy.choose(op, dtype, nbytes, self.world)
        # Native means torch.distributed's own op: only a one-domain group has it.
        return plan if self.native or plan != "native" else "raw"

    def coded(self, plan: str, dtype: torch.dtype, nbytes: int) -> Callable[[int], bool]:
        """Whether each peer pair compresses under plan: every pair, or in a
        mixed cluster only hops between domains, and under auto only pairs
        whose two codecs beat the link (a CPU rank's may not)."""
        if plan != "compressed":
            return _never
        if not self.mixed:
            return _always
        if self.mode == "always":
            return self.cross
        per = max(nbytes // self.world, 1)
        return lambda p: self.cross(p) and self.policy.pair_pays(dtype, per, self.rank, p)

    def pair(self, ts: List[torch.Tensor], peer: int) -> str:
        """The plan of one peer pair in a send/recv group, from what both
        sides hold alike: the pair's tensors in both directions (one side's
        sends are the other's receives), as bytes per dtype; in a mixed
        cluster, from the pair's own codecs too."""
        total: Dict[torch.dtype, int] = defaultdict(int)
        for t in ts:
            total[t.dtype] += t.nbytes
        if self.mixed:
            if not self.cross(peer) or self.mode == "never":
                return "raw"
            pays = self.mode == "always" or any(self.policy.pair_pays(dtype, n, self.rank, peer, p2p=True)
                                                 for dtype, n in total.items())
            return "compressed" if pays else "raw"
        plans = {self.op("send", dtype, n) for dtype, n in total.items()} or {"native"}
        if plans == {"native"}:
            return "native"
        return "compressed" if "compressed" in plans else "raw"


def _always(peer: int) -> bool:
    return True


def _never(peer: int) -> bool:
    return False
