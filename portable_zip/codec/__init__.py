"""The codec's face: everything the layers above use of it (comm, the
weights engine, the KV path, the torch ops), and nothing else.

Beyond the user API (compress / decompress, their batch forms, inspect,
trim, sizes, checks, the delta codec), comm's pipeline needs:
  compress_padded   compress into a max_compressed_size buffer, no trim;
  decode_queued     queue a GPU decode whose header is parsed, errors into a tensor;
  stream_layout, parse_header, decode_error_text, size_field: a stream's
                    header and size where only bytes travel;
  max_sms_in_force  the SM limit a call runs under (sm_budget);
  load_device_code, device_vendor, has_device_code: the vendor runtime and
                    kernels (the fabric's staging copies use the runtime);
  overlaps, check_out: the argument checks the Communicator shares.
dtypes: the dtype codes of the format and the coded dtypes (CODED)."""
from . import delta
from .checks import check
from .dtypes import CODE_TO_DTYPE, CODED, DTYPE_TO_CODE, code_of, dtype_of
from .errors import FormatError, MismatchError
from .streams import (
    FORMAT_VERSION,
    backend_info,
    check_out,
    compress,
    compress_batch,
    compress_padded,
    compressed_size,
    decode_error_text,
    decode_queued,
    decompress,
    decompress_batch,
    inspect,
    max_compressed_size,
    max_sms_in_force,
    overlaps,
    parse_header,
    size_field,
    sm_budget,
    stream_layout,
    trim,
)
from .device import has_code as has_device_code, require as load_device_code, vendor as device_vendor

__all__ = [
    "CODED", "CODE_TO_DTYPE", "DTYPE_TO_CODE", "FORMAT_VERSION", "FormatError", "MismatchError", "backend_info",
    "check", "check_out", "code_of", "compress", "compress_batch", "compress_padded", "compressed_size",
    "decode_error_text", "decode_queued", "decompress", "decompress_batch", "delta", "device_vendor", "dtype_of",
    "has_device_code", "inspect", "load_device_code", "max_compressed_size", "max_sms_in_force", "overlaps", "parse_header",
    "size_field", "sm_budget", "stream_layout", "trim",
]
