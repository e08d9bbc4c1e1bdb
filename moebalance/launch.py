r"""Run a function on every rank of a gloo (or NCCL) group: under torchrun, or spawned here.

Examples and benchmarks run both ways::

    python examples/X.py                                        # spawns the ranks itself
    torchrun --standalone --nproc-per-node 4 examples/X.py      # one process per rank
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        examples/X.py

:func:`launch` tells the two apart by the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``): under torchrun it joins the process group from it and runs ``fn`` in this
process; otherwise it spawns ``world_size`` processes that meet on a free local port.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import socket
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ._check import positive_int

__all__ = ["launch", "under_torchrun", "require_world_size"]

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")


def under_torchrun() -> bool:
    """True when torchrun (or another env:// launcher) started this process as one rank."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, world_size: int, init_method: str | None, backend: str, timeout_s: float,
         threads: int | None, fn: Callable, args: tuple):
    if threads is not None:
        torch.set_num_threads(threads)
        if importlib.util.find_spec("numba") is not None:
            import numba

            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    kwargs = {"timeout": timedelta(seconds=timeout_s)}
    if init_method is None:
        dist.init_process_group(backend, **kwargs)            # env:// from torchrun
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, **kwargs)
    try:
        result = fn(dist.get_rank(), dist.get_world_size(), *args)
        dist.barrier()    # no rank tears its group down while a peer may still talk to it
        return result
    finally:
        # Objects in reference cycles that still hold the group must go before it does: left
        # to interpreter exit, gloo's threads can be torn down under them (an abort at exit).
        gc.collect()
        dist.destroy_process_group()


def require_world_size(world_size: int, needed: int) -> None:
    """Stop this rank with one line unless the job runs on ``needed`` ranks (a script whose
    topology describes one device per rank): call it first thing in ``fn``, before the
    imports and collectives a wrong world size would fail in."""
    if world_size != needed:
        raise SystemExit(f"this job describes {needed} devices, one per rank, and runs on "
                         f"{world_size} ranks: start it with torchrun --nproc-per-node {needed}, "
                         f"or run it directly (it spawns {needed} ranks)")


def launch(fn: Callable, world_size: int = 4, *, args: tuple = (), backend: str = "gloo",
           timeout_s: float = 300.0, threads: int | None = 1) -> None:
    """Call ``fn(rank, world_size, *args)`` on every rank with the default group initialised.

    Args:
        fn: a module-level function (it is pickled by reference when spawned).
        world_size: ranks to spawn when not under torchrun (under torchrun its world size wins).
        args: extra positional arguments for ``fn``.
        backend: "gloo" (CPUs) or "nccl" (one GPU per rank).
        timeout_s: collective timeout, so a rank waiting on a dead peer fails instead of hanging.
        threads: torch and Numba threads per rank (ranks sharing a few cores starve each other
            with more; spawned ranks also get OMP_NUM_THREADS and NUMBA_NUM_THREADS unless set);
            None leaves the defaults.
    """
    world_size = positive_int(world_size, "world_size")
    if under_torchrun():
        _run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, backend, timeout_s,
             threads, fn, args)
        return
    init = f"tcp://127.0.0.1:{_free_port()}"
    # Thread pools must be sized before the children import torch and Numba: ranks that share
    # cores and each spin an OpenMP pool of all of them run many times slower (torchrun sets
    # OMP_NUM_THREADS=1 for the same reason).
    saved = {name: os.environ.get(name) for name in _THREAD_VARIABLES}
    if threads is not None:
        for name in _THREAD_VARIABLES:
            os.environ.setdefault(name, str(threads))
    try:
        mp.spawn(_run, args=(world_size, init, backend, timeout_s, threads, fn, args),
                 nprocs=world_size, join=True)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
