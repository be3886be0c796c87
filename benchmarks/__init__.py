"""relay_hf's benchmarks (not part of the installed package). Run from the repository root:

    python -m benchmarks.kernel ...     # one decode attention layer
    python -m benchmarks.generate ...   # end-to-end ``generate``
    python -m benchmarks.plot ...       # the plots of docs/performance.md, from benchmarks/data/*.csv

See benchmarks/README.md for the CSV schema.
"""
