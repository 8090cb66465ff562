"""Helpers of the benchmark scripts in bench/ (run from a source checkout;
not part of the installed package). A script puts bench/ on sys.path, even
under python -P, and imports the module it needs:

    common    sizes, timing, machine metadata, tables and result files; the CPU codec rows (codec_rows)
    refs      the reference GPU codecs (nvCOMP, DietGPU) and ours behind one interface
    cpu_refs  the reference CPU codecs (zstd, ZipNN) beside ours
    comm      communication benchmark workers and links (ranks run by tests/harness)

The benchmark tensors and the multi-process harness are the tests' own
(tests/harness), put on sys.path here.
"""
import os
import sys

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
