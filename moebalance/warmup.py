"""Compile every Numba kernel ahead of a job (or load it from Numba's on-disk cache).

Top floor: it drives the planner and an ``ExpertParallelMoE`` forward and backward, so it sits
above them; :mod:`moebalance.backends`, which they import, only reports whether Numba is there.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

import numpy as np
import torch

from .backends import has_numba
from .dispatch.shares import step_imbalance
from .nn.moe import DenseMoE, ExpertParallelMoE
from .planner import plan, rebalance_experts, resplit_device_loads
from .topology import Topology

__all__ = ["warm_up", "jit_counts"]


def jit_counts() -> tuple[int, int]:
    """``(loaded, compiled)``: Numba kernels this process has so far loaded from Numba's on-disk
    cache, and compiled afresh (one per kernel and signature), over the planner and dispatch
    kernels; ``(0, 0)`` without Numba. Take it before and after a call to see what it did."""
    if not has_numba():
        return 0, 0
    from numba.core.registry import CPUDispatcher

    from .planner import _jit

    kernels = list(vars(_jit.kernels("numba")).values())
    dispatch = sys.modules.get("moebalance.dispatch.numba_kernels")  # only once something used it
    if dispatch is not None:
        kernels += [k for k in vars(dispatch).values() if isinstance(k, CPUDispatcher)]
    loaded = compiled = 0
    for k in kernels:
        loaded += sum(k.stats.cache_hits.values())
        compiled += sum(k.stats.cache_misses.values())
    return loaded, compiled


PARTS = ("planner", "rebalance_experts", "dispatch")


def warm_up(progress: Callable[[str], None] | None = None,
            parts: Sequence[str] = PARTS) -> dict[str, float]:
    """Compile every Numba kernel now (or load it from Numba's on-disk cache), so the first
    plan() or forward pass of a job does not pay for it. Returns seconds spent per part.

    ``progress``, if given, is called with each part's name ("planner", "rebalance_experts",
    "dispatch") as it starts: a cold compile takes tens of seconds per part. Set-up calls this
    once; a job may call it at start-up, off the training step. ``parts`` (names of
    :data:`PARTS`) limits it to those parts; the others compile on first use.
    """
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"parts must be among {list(PARTS)}, got {unknown}")
    spent: dict[str, float] = {}
    if not has_numba():
        return spent
    # Unlike devices take both packing attempts; a previous placement takes the repair path.
    topo = Topology.from_arrays([1.0, 0.5, 2.0], [3, 4, 2], [0, 0, 1])
    w = np.linspace(1.0, 40.0, 2 * 7).reshape(2, 7)

    def planner() -> None:
        previous = plan(w, topo, backend="numba")
        plan(w[:, ::-1].copy(), topo, previous=previous, max_moves=3, backend="numba")
        plan(w, topo, spread=np.stack([w, w[:, ::-1]]), backend="numba")  # spread-aware path
        # The Rebalancer's calls: a window of per-step counts, planned fresh and against the
        # placement in force, judged step by step. A placement's arrays are read-only, which
        # Numba compiles apart from writable ones: each job's first re-plan would compile them.
        # Devices alike in speed and slots take the renaming path too.
        alike = Topology.from_arrays([1.0, 1.0, 0.5, 0.5], [3, 3, 3, 3], [0, 0, 1, 1])
        window = np.stack([w * (1.0 + 0.1 * t) for t in range(8)])
        fresh = plan(window, alike, backend="numba")
        plan(window[:, :, ::-1].copy(), alike, previous=fresh, max_moves=3, backend="numba")
        step_imbalance(window, fresh, alike, backend="numba")
        resplit_device_loads(window[:, 0], fresh.phy2log[0], fresh.share[0], alike,
                             backend="numba")

    def drop_in() -> None:
        rebalance_experts(w[:, :6].copy(), 12, 2, 2, 4)   # hierarchical
        rebalance_experts(w[:, :6].copy(), 12, 1, 1, 4)   # global

    def dispatch() -> None:
        placement = plan(w[:1, :4].copy(), Topology.uniform(1, 4), backend="numba")
        for dtype in (torch.float32, torch.float64):
            moe = ExpertParallelMoE.from_dense(DenseMoE(8, 16, 4, 2).to(dtype), placement)
            x = torch.randn(6, 8, dtype=dtype, requires_grad=True)
            moe(x).sum().backward()
        # One device holds no two replicas of an expert: the re-split kernel warms on its own.
        from .dispatch.routing import replica_table
        from .dispatch.shares import resplit_plan, resplit_shares

        table = replica_table(plan(w[:1, :3].copy(), Topology.uniform(2, 2), backend="numba"), 0)
        resplit_shares(torch.ones(3), table.share_EX, resplit_plan(table, [1.0, 1.0]))
        # A layer with transient slots (transient=K) chooses its copies at every step, with
        # the dispatcher's host arrays: the first step would compile the rule.
        from .dispatch.transient import TransientRouting

        routing = TransientRouting(*(t.numpy() for t in (table.slots_EX, table.device_EX,
                                                         table.share_EX)),
                                   np.array([0, 2, 4]),     # each rank's first slot (2 each)
                                   1, [1.0, 1.0], [0, 0], 1.0)
        routing.choose(np.array([[40, 1, 1], [40, 1, 1]], dtype=np.int64))

    for name, part in (("planner", planner), ("rebalance_experts", drop_in),
                       ("dispatch", dispatch)):
        if name not in parts:
            continue
        if progress is not None:
            progress(name)
        start = time.perf_counter()
        part()
        spent[name] = time.perf_counter() - start
    return spent
