"""Process-group plumbing shared by the multi-process tests (``tests/_workers``) and the
data-parallel benchmark (``rlvr_kernels.bench.distributed``): gloo on CPU, started with
``torch.multiprocessing.spawn``; and the world-size-1 group the peers' engines run in within
one process (:func:`single_process_group`)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
import sys
import tempfile
import traceback
from typing import Iterator

import torch

# A bounded collective timeout: a rank left waiting in a collective fails the test instead of
# hanging the suite.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous of one spawn)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int) -> None:
    """Join the gloo group of ``world`` local processes, one CPU thread each (the ranks share
    a few cores)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    torch.set_num_threads(1)


@contextlib.contextmanager
def gloo_process(rank: int, world: int, port: int) -> Iterator[object]:
    """The body of one spawned rank: joins the group (``init_gloo``), yields the WORLD group,
    and on success waits for every rank, destroys the group and ends the process with
    ``os._exit(0)``. Gloo's threads and the torch objects that reference the group (a DDP
    reducer, FSDP2 state) otherwise meet in their C++ destructors at interpreter teardown,
    which now and then aborts ("terminate called without an active exception") or deadlocks
    on the GIL after every check passed. On an exception the traceback goes to stderr (the
    test shows it) and the process ends with ``os._exit(1)``, which ``spawn`` reports as a
    failed rank, for the same reason: an orderly teardown could hang the failing test."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    try:
        yield dist.group.WORLD
    except BaseException:
        traceback.print_exc()
        sys.stderr.write(f"rank {rank} of {world} failed\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    gc.collect()  # wrapped modules that hold the group die while it is alive
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A world-size-1 gloo process group (a peer engine's collectives run in it), unless one
    exists; destroyed after if created here."""
    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(prefix="rk-gloo-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        created = True
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()
