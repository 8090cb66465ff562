"""torch.library registration, with fake implementations for torch.compile.

The ops take the padded form (max_compressed_size bytes) so their output size
depends only on the input's metadata. pz.compress/decompress call the same
implementation directly, skipping the dispatcher on the hot path.
"""
from __future__ import annotations

import torch

from . import codec


@torch.library.custom_op("portable_zip::compress", mutates_args=())
def compress_op(t: torch.Tensor) -> torch.Tensor:
    # Zeros past the stream: the op's output is a pure function of its input.
    return codec.compress_padded(t, zero_pad=True)


@compress_op.register_fake
def _(t):
    return t.new_empty(codec.max_compressed_size(t.numel(), t.dtype, t.dim()), dtype=torch.uint8)


@torch.library.custom_op("portable_zip::decompress_into", mutates_args=("out",))
def decompress_into_op(buf: torch.Tensor, out: torch.Tensor) -> None:
    codec.decompress(buf, out=out)


@decompress_into_op.register_fake
def _(buf, out):
    return None


# A lazy conj/neg `out` reaches torch's Conjugate/Negative fallbacks before our
# kernel, and they fail on an op returning nothing ("Expected Tensor but got
# None"). Claim those keys to raise the same clear error as pz.decompress.
_lazy_lib = torch.library.Library("portable_zip", "IMPL")


def _reject_lazy_out(buf, out):
    codec.check_out(out)
    raise ValueError("decompress_into: a lazy conj/neg tensor reached the op")  # only if the flag was on buf


_lazy_lib.impl("decompress_into", _reject_lazy_out, "Conjugate")
_lazy_lib.impl("decompress_into", _reject_lazy_out, "Negative")
