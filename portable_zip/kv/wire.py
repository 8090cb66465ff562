"""The stream between one sender rank and one receiver rank: fixed-size
int64 descriptors, each LAYER one followed by its payload. Both sides post
the same sequence (descriptor, payload, descriptor, ...), one transfer at a
time, on the KV tag of the Communicator's point-to-point path."""
from __future__ import annotations

import dataclasses
import hashlib

import torch

MAGIC = 0x505A4B56  # "PZKV"
VERSION = 1
WORDS = 16
TAG = 0x4B56  # "KV": the point-to-point tag of every KV message, apart from the caller's own on tag 0
# Kinds: a layer's blocks (a payload follows); nothing to send for a while;
# the sender closes the stream; the sender gave a request up.
LAYER, KEEPALIVE, BYE, ABORT = 1, 2, 3, 4
KINDS = (LAYER, KEEPALIVE, BYE, ABORT)


def request_key(request_id) -> int:
    """The request's 63-bit wire key (blake2b of its id as text): the id
    itself never travels; two live ids with one key raise on either side."""
    if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
        raise TypeError(f"request_id must be a str or an int, got {type(request_id).__name__}")
    d = hashlib.blake2b(f"{type(request_id).__name__}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") >> 1


def signed(u: int) -> int:
    """A 64-bit unsigned value as the int64 that holds its bits."""
    return u - (1 << 64) if u >= 1 << 63 else u


@dataclasses.dataclass
class Descriptor:
    kind: int
    key: int = 0
    layer: int = 0
    first_block: int = 0    # the request's logical block the payload starts at
    count: int = 0          # blocks in the payload
    final: int = 0          # 1: this layer's last chunk of the request
    dtype: int = 0          # layout.DTYPES code
    block_size: int = 0
    heads: int = 0
    head_dim: int = 0
    checksum: int = 0       # pz.delta.checksum of the payload's bytes, as int64
    scales: int = 0         # fp8 per-tensor scales that follow (0-2)
    k_scale: int = 0        # int32 bit patterns
    v_scale: int = 0

    def tensor(self) -> torch.Tensor:
        words = [MAGIC, VERSION] + [getattr(self, f.name) for f in dataclasses.fields(self)]
        return torch.tensor(words, dtype=torch.int64)

    def payload_shape(self) -> tuple:
        return (2, self.count, self.block_size, self.heads, self.head_dim)

    @classmethod
    def parse(cls, t: torch.Tensor) -> "Descriptor":
        """Raises ValueError for anything this version did not write."""
        w = t.tolist()
        if len(w) != WORDS or w[0] != MAGIC:
            raise ValueError(f"not a KV descriptor (first word {w[0]:#x})")
        if w[1] != VERSION:
            raise ValueError(f"KV wire version {w[1]}, this side speaks {VERSION}")
        d = cls(*w[2:])
        if d.kind not in KINDS:
            raise ValueError(f"unknown descriptor kind {d.kind}")
        if d.kind == LAYER and (min(d.count, d.block_size, d.heads, d.head_dim) < 0 or d.scales not in (0, 1, 2)
                                or d.final not in (0, 1) or d.first_block < 0 or d.layer < 0):
            raise ValueError(f"malformed layer descriptor {w}")
        return d
