r"""Run a function on every rank of a gloo (or NCCL) group: under torchrun, or spawned here.

Examples and benchmarks run both ways::

    python examples/X.py                                        # spawns the ranks itself
    torchrun --standalone --nproc-per-node 4 examples/X.py      # one process per rank
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        examples/X.py

:func:`launch` tells the two apart by the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``): under torchrun it joins the process group from it and runs ``fn`` in this
process; otherwise it starts ``world_size`` processes that meet on a free local port. Gloo ranks
fork from one server process that imported the script, torch and moebalance once (about a second
of CPU per rank saved, several with transformers or Lightning: name them in ``preload``); NCCL
ranks are spawned.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import socket
from datetime import timedelta
from multiprocessing.reduction import DupFd
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


def _modules(preload) -> tuple:
    """``preload`` as a tuple of names of installed modules, or a ValueError naming the fix."""
    preload = (preload,) if isinstance(preload, str) else tuple(preload)
    for name in preload:
        try:
            found = isinstance(name, str) and importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"preload names {name!r}, which is not an installed module: name "
                             f"modules every rank imports, e.g. preload=('lightning',)")
    return preload


# The thread settings the fork server was started with: its children inherit what it imported.
_server_threads: dict | None = None


def _start_method(backend: str, threads: int | None, fn: Callable, preload: tuple) -> str:
    """How to start the ranks: gloo ranks fork from one server process that imported the
    script, torch, moebalance and ``preload`` once (a spawned rank imports them again: seconds of
    CPU per rank). NCCL ranks are spawned, as a process that touched CUDA must not fork, and so
    are ranks with default thread pools: OpenMP loaded at its default size in the server leaves
    forked ranks spinning."""
    global _server_threads
    if backend != "gloo" or threads is None:
        return "spawn"
    pools = {name: os.environ.get(name) for name in _THREAD_VARIABLES}
    if _server_threads is None:
        modules = ["__main__", "torch", "torch._dynamo", "moebalance", *preload]
        if fn.__module__ not in ("__main__", "__mp_main__"):
            modules.append(fn.__module__)
        modules.append("moebalance._fork_ready")
        mp.get_context("forkserver").set_forkserver_preload(modules)
        _server_threads = pools
    elif pools != _server_threads:
        return "spawn"       # the server's imports sized their thread pools otherwise
    return "forkserver"


class _CallerStdio:
    """The caller's stdout and stderr as they are at launch, for a rank forked from the server
    (which holds the ones it started with: a test's capture, a notebook's, may have moved
    since). Pickled into the rank's arguments, the descriptors travel with them."""

    def __init__(self, fds: list | None = None):
        self.fds = fds

    def __reduce__(self):
        return (_CallerStdio, ([DupFd(fd) for fd in (1, 2)],))

    def attach(self) -> None:
        for target, fd in zip((1, 2), self.fds):
            fd = fd.detach()
            os.dup2(fd, target)
            os.close(fd)


def _run(rank: int, world_size: int, init_method: str | None, backend: str, timeout_s: float,
         threads: int | None, fn: Callable, args: tuple, caller: tuple | None = None):
    if caller is not None:
        # A forked rank has the fork server's environment and output: give it the caller's, as
        # a spawned rank would have.
        environ, stdio = caller
        os.environ.clear()
        os.environ.update(environ)
        stdio.attach()
    if threads is not None:
        torch.set_num_threads(threads)
        if importlib.util.find_spec("numba") is not None:
            import numba

            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        # One GPU per rank (torchrun's LOCAL_RANK, else the rank): NCCL refuses two ranks on one
        # GPU, and object collectives use the current device.
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local % torch.cuda.device_count())
    kwargs = {"timeout": timedelta(seconds=timeout_s)}
    if init_method is None:
        dist.init_process_group(backend, **kwargs)            # env:// from torchrun
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, **kwargs)
    if caller is None:
        # What the imports made (torch, transformers: millions of objects) lives as long as the
        # rank: left out of the collector's scans, full collections stop walking it at every
        # step. A forked rank has it frozen already, by the server (_fork_ready).
        gc.collect()
        gc.freeze()
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
           timeout_s: float = 300.0, threads: int | None = 1, preload: tuple = ()) -> None:
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
        preload: modules every rank imports (transformers, lightning), imported once before
            gloo ranks fork rather than once per rank.
    """
    world_size = positive_int(world_size, "world_size")
    preload = _modules(preload)
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
        method = _start_method(backend, threads, fn, preload)
        caller = (dict(os.environ), _CallerStdio()) if method == "forkserver" else None
        mp.start_processes(_run, nprocs=world_size, join=True, start_method=method,
                           args=(world_size, init, backend, timeout_s, threads, fn, args, caller))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
