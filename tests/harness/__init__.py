"""Helpers the tests and the benchmarks (bench/pzbench) share; not part of
the installed package.

    ranks    run a function on N local processes with a deadline (run_ranks)
    tensors  the benchmark tensors, their ratio bars and the entropy bound
"""
