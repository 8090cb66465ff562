"""Paged KV-cache layouts: a layer's cache as one tensor [2, num_blocks,
block_size, heads, head_dim] (vLLM's flash-attn layout) or as separate K and
V tensors [num_blocks, block_size, heads, head_dim], with optional fp8
per-tensor scales. A request's blocks of a layer travel as one payload
[2, n, block_size, heads, head_dim] (K then V), whatever either side's layout
or strides."""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional, Sequence

import torch

# Wire codes of the dtypes a cache may hold (0 is never a dtype).
DTYPES = {1: torch.bfloat16, 2: torch.float16, 3: torch.float8_e4m3fn, 4: torch.float8_e5m2, 5: torch.float32}
CODES = {d: c for c, d in DTYPES.items()}
# Gathers and scatters run on same-width integer views: every dtype, fp8 too, on every device.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclasses.dataclass
class KVLayer:
    """One layer's paged cache: kv (fused [2, blocks, block_size, heads,
    head_dim]) or k and v (each [blocks, block_size, heads, head_dim]); fp8
    caches may carry per-tensor k_scale / v_scale (one float32 element each),
    which travel bit for bit beside the blocks."""
    kv: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None

    def __post_init__(self):
        if (self.kv is None) == (self.k is None and self.v is None) or (self.kv is None and
                                                                        (self.k is None or self.v is None)):
            raise ValueError("a KV layer is either kv=[2, blocks, block_size, heads, head_dim] or both k= and v= "
                             "[blocks, block_size, heads, head_dim]")
        if self.kv is not None:
            if self.kv.dim() != 5 or self.kv.shape[0] != 2:
                raise ValueError(f"a fused KV cache is [2, blocks, block_size, heads, head_dim], got "
                                 f"{list(self.kv.shape)}")
        else:
            if self.k.dim() != 4 or self.k.shape != self.v.shape or self.k.dtype != self.v.dtype \
                    or self.k.device != self.v.device:
                raise ValueError(f"K and V caches must be [blocks, block_size, heads, head_dim] of one shape, dtype "
                                 f"and device, got {list(self.k.shape)} {self.k.dtype} {self.k.device} and "
                                 f"{list(self.v.shape)} {self.v.dtype} {self.v.device}")
        if self.dtype not in CODES:
            raise TypeError(f"KV caches of {self.dtype} are not supported (bf16, fp16, fp8 e4m3/e5m2, fp32)")
        for name in ("k_scale", "v_scale"):
            s = getattr(self, name)
            if s is not None and (not isinstance(s, torch.Tensor) or s.numel() != 1 or s.dtype != torch.float32):
                raise ValueError(f"{name} must be a one-element float32 tensor")

    @property
    def _first(self) -> torch.Tensor:
        return self.kv if self.kv is not None else self.k

    @property
    def dtype(self) -> torch.dtype:
        return self._first.dtype

    @property
    def device(self) -> torch.device:
        return self._first.device

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[1] if self.kv is not None else self.k.shape[0]

    @property
    def block_shape(self) -> tuple:
        """(block_size, heads, head_dim)."""
        return tuple(self._first.shape[-3:])

    def payload_shape(self, n: int) -> tuple:
        return (2, n) + self.block_shape

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The blocks ids (int64, on this layer's device) as a new contiguous payload."""
        bits = _BITS[self._first.element_size()]
        if self.kv is not None:
            out = self.kv.view(bits).index_select(1, ids)
        else:
            out = torch.stack([self.k.view(bits).index_select(0, ids), self.v.view(bits).index_select(0, ids)])
        return out.view(self.dtype)

    def scatter(self, ids: torch.Tensor, payload: torch.Tensor) -> None:
        """Write payload [2, n, ...] into blocks ids and nothing else."""
        bits = _BITS[self._first.element_size()]
        src = payload.view(bits)
        if self.kv is not None:
            self.kv.view(bits).index_copy_(1, ids, src)
        else:
            self.k.view(bits).index_copy_(0, ids, src[0])
            self.v.view(bits).index_copy_(0, ids, src[1])

    def scale_bits(self) -> list:
        """[count, k bits, v bits]: the scales as int32 bit patterns (read on the host)."""
        have = [s for s in (self.k_scale, self.v_scale) if s is not None]
        bits = [int(s.detach().reshape(1).cpu().view(torch.int32)[0]) for s in have]
        return [len(have)] + bits + [0] * (2 - len(bits))

    def set_scales(self, count: int, k_bits: int, v_bits: int) -> None:
        mine = [s for s in (self.k_scale, self.v_scale) if s is not None]
        if count != len(mine):
            raise ValueError(f"the sender's layer has {count} fp8 scales, this one {len(mine)}")
        for s, b in zip(mine, (k_bits, v_bits)):
            s.reshape(1).view(torch.int32).copy_(torch.tensor([b], dtype=torch.int32))


def as_layer(x) -> KVLayer:
    """A KVLayer from a KVLayer, a fused tensor, a (K, V) pair or a dict of KVLayer's fields."""
    if isinstance(x, KVLayer):
        return x
    if isinstance(x, torch.Tensor):
        return KVLayer(kv=x)
    if isinstance(x, dict):
        return KVLayer(**x)
    if isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x):
        return KVLayer(k=x[0], v=x[1])
    raise TypeError(f"a KV layer is a tensor [2, blocks, ...], a (K, V) pair, a dict or a KVLayer, "
                    f"got {type(x).__name__}")


def as_layers(caches) -> list:
    """Every layer of caches (a sequence, or a dict in layer order) as KVLayers."""
    if isinstance(caches, dict):
        caches = list(caches.values())
    if isinstance(caches, (torch.Tensor, KVLayer)) or not isinstance(caches, Sequence) or not len(caches):
        raise TypeError("kv_caches must be a non-empty sequence (or dict) of per-layer caches")
    return [as_layer(c) for c in caches]


def block_ids(ids, num_blocks: int, what: str, unique: bool) -> torch.Tensor:
    """ids as an int64 CPU tensor after checking each names a block (and, where
    unique, none twice: two payload blocks into one slot would race)."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 1:
            raise TypeError(f"{what} must be a 1-D integer tensor or a sequence of ints")
        out = ids.detach().to("cpu", torch.int64)
    else:
        ids = list(ids)
        if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in ids):
            raise TypeError(f"{what} must be ints, got {ids[:8]}")
        out = torch.tensor(ids, dtype=torch.int64)
    if out.numel() and (int(out.min()) < 0 or int(out.max()) >= num_blocks):
        raise ValueError(f"{what} must lie in [0, {num_blocks}), got min {int(out.min())} max {int(out.max())}")
    if unique and out.unique().numel() != out.numel():
        raise ValueError(f"{what} names a block twice")
    return out
