"""Benchmark and demo helpers behind `python -m portable_zip bench|demo` and
the scripts in the repository's bench/ folder. Not imported by
`import portable_zip`: import the module you need.

    common  sizes, timing, machine metadata, tables and result files; the `bench --codec` rows (codec_rows)
    data    the benchmark tensors, their ratio bars and the entropy bound
    codec   GPU codec throughput, ours beside the references (child process per system)
    refs    the reference GPU codecs (nvCOMP, DietGPU) and ours behind one interface
    comm    communication benchmarks and the local multi-process harness (run_ranks)
    demo    the two-process weight-sync demo
"""
