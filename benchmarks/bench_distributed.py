"""Communication of the ops under ``process_group`` (2 and 4 gloo processes): collectives per
call and bytes per rank against a naive all-gather; see ``rlvr_kernels/bench/distributed.py``.

    .venv/bin/python benchmarks/bench_distributed.py   # table + benchmarks/results/<date>-cpu-distributed.*
"""

from rlvr_kernels.bench.distributed import main

if __name__ == "__main__":
    raise SystemExit(main())
