"""GPU codec throughput against size: ours vs nvCOMP ANS vs DietGPU's float
codec, compress and decompress, on the same tensors in one run. Prints a
table, writes JSON and a PNG plot. Same as `python -m portable_zip bench --codec`.

    python bench/codec.py [--sizes 1MiB,...,1GiB] [--max-sms 33,66] [--json out.json] [--png out.png]

nvCOMP comes from the nvidia-nvcomp-cu13 wheels; DietGPU from
bench/ref/build_dietgpu.sh (PZ_DIETGPU_LIB points at its libdietgpu.so).
A reference that is missing is reported as an error row, not a failure.
"""
import sys

from portable_zip.bench.codec import main

if __name__ == "__main__":
    sys.exit(main())
