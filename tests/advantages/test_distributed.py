"""Data-parallel ``group_advantages`` (``process_group``): 2 and 4 CPU processes (gloo,
started by the test), groups split over the ranks (uneven shards, a rank with no sample,
masked and unscorable samples): every rank's advantages equal one process on the whole
batch (bitwise for exact float64 group sums, to float64 rounding otherwise), the group
statistics are bitwise equal on every rank, and a bad input on one rank is an error on every
rank (a bounded collective timeout turns a hang into a failure)."""

import pytest
import torch.multiprocessing as mp
from _workers.advantages_dist import advantages_dist_worker

from rlvr_kernels.testing.dist import free_port


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_equals_one_process(world):
    # The worker lives in rlvr_kernels.testing: a spawned process unpickles it by module name.
    mp.spawn(advantages_dist_worker, args=(world, free_port()), nprocs=world, join=True)
