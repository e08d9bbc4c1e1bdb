"""plan(): replica counts, slot assignment and token shares for every MoE layer at once.

This module checks the arguments, chooses the route and builds the :class:`Placement`. The
method is told in :mod:`.core`, one file per step (counts, packing, shares, chain, improve,
repair, fresh), plain Python (the reference) that runs compiled by Numba when it is available
(:func:`moebalance.backends`, part ``planner``; :func:`._jit.kernels`). Given a window of
per-step counts ``[T, L, E]``, ``plan`` plans for the steps after the
per-step re-split (:mod:`moebalance.planner.steps`, whose docstring gives the rule: volatile
and large experts liquid on one ring of devices, so a step's excess can flow; the small calm
ones alone); :mod:`moebalance.planner.trigger` says when a re-plan's moves pay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._check import as_loads, integer, to_numpy
from ..placement import Placement
from ..topology import Topology, planning_loads

# every kernel module, so that every kernel is registered before any compile
from . import (  # noqa: F401
    _jit,
    chain,
    counts,
    eplb,
    fresh,
    improve,
    packing,
    relabel,
    repair,
    shares,
    steps,
)
from .core import MAX_SWEEPS, devices_of
from .eplb import rebalance_experts

# With a previous placement, moves go to a layer while its hottest device is more than this
# fraction above what a fresh plan reaches: moves are only spent where they buy real balance.
DEFAULT_TOLERANCE = 0.005


def resplit_device_loads(counts_TE, phy2log_S, share_S, topology: Topology,
                         backend: str | None = None) -> np.ndarray:
    """[T, G] device loads of one layer at every step of ``counts_TE`` [T, E] when each step's
    tokens are re-split over the replicas of ``phy2log_S`` / ``share_S`` [S] (water filling
    from those shares, as the dispatcher's per-step re-split does), with the planner's kernels
    (``backend`` as in :func:`plan`; default: :func:`moebalance.backends`)."""
    return _jit.kernels(backend).resplit_device_loads(
        np.ascontiguousarray(counts_TE, dtype=np.float64), devices_of(topology), phy2log_S,
        share_S, MAX_SWEEPS)


@dataclass(frozen=True)
class MoveCost:
    """What one expert move costs, against the step time it saves until the next re-plan.

    Args:
        bytes_per_move: bytes one expert copy transfers (DeepSeek-V3: 88e6 for bf16 weights,
            617e6 with an fp32 master copy and two Adam moments).
        bandwidth: bytes per second of the link a copy travels over.
        steps: steps the new placement serves before the next re-plan.
        step_seconds: seconds the MoE layers of one step take at perfect balance (the ideal
            time); a layer's share of it is its share of the ideal times.

    A re-plan keeps a layer's moves only when the time they save, ``(old - new hottest time) /
    sum of ideal times * step_seconds * steps``, exceeds their transfer time ``moves *
    bytes_per_move / bandwidth``; otherwise the layer keeps its placement (shares re-split).
    """

    bytes_per_move: float
    bandwidth: float
    steps: float
    step_seconds: float

    def __post_init__(self) -> None:
        for name in ("bytes_per_move", "bandwidth", "steps", "step_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                                  np.floating)) \
                    or not np.isfinite(value) or value <= 0:
                raise ValueError(f"MoveCost({name}=...) must be a finite number > 0, got "
                                 f"{value!r}")

    @property
    def per_move(self) -> float:
        """Price of one move in units of the summary imbalance (DESIGN section 2): a move is
        worth making when it lowers ``sum_l max_l / sum_l ideal_l`` by more than this."""
        return self.bytes_per_move / self.bandwidth / (self.steps * self.step_seconds)


def plan(loads, topology: Topology, previous: Placement | None = None,
         max_moves: int | None = None, *, move_cost: MoveCost | None = None, spread=None,
         tolerance: float = DEFAULT_TOLERANCE, polish: int = 0,
         backend: str | None = None) -> Placement:
    """Plan expert replicas, their devices and their token shares for every layer.

    Args:
        loads: [L, E] (or [E]) predicted tokens per logical expert, or [T, L, E] the per-step
            counts of a recent window (what :class:`~moebalance.LoadTracker` keeps): the plan
            is then for the steps, as with ``spread``. Loads drift: the predicted load is the
            mean of the window's last steps that still describe it (the whole window when
            the loads held steady; half or a quarter of it when, held out, the last quarter
            of the window is nearer those steps' mean), and the window's steps are moved to
            that level (:func:`.steps.planning_window`); numpy, torch (CPU or CUDA) or cupy;
            finite and >= 0.
        topology: the devices (speed, slots, node); S = topology.num_slots >= E.
        previous: the placement in service now. Experts stay where they are unless moving them
            buys real balance; ``previous`` is not modified.
        max_moves: at most this many expert copies in total over all layers (needs
            ``previous``); None: no limit. A hard cap.
        move_cost: a :class:`MoveCost` (needs ``previous``): a layer's moves are kept only when
            the step time they save until the next re-plan exceeds the time they take.
        spread: how the loads move from step to step: the per-step counts [T, L, E] of the
            window the loads were averaged over. The plan then minimises each step's hottest
            device *after* the per-step re-split, not the mean's: per layer it keeps, of the
            window-mean plan and the plans for the steps (:mod:`.steps`: replicas by spread
            and mean, the volatile and large experts liquid on a ring of devices, the small
            calm ones alone), the one whose replicas finish the window's steps (up to
            ``steps.STEP_SAMPLES`` of them, evenly spaced) earliest on average when each step's
            tokens are re-split over them. With ``previous`` a layer changes only when that
            figure improves by more than ``tolerance`` (and pays for its moves under
            ``move_cost``, fits ``max_moves``); its candidates are then the placement in
            service, its repair and the fresh plan, whose devices of equal speed and slots are
            first renamed after the placement in service (:mod:`.relabel`: same balance, the
            fewest moves such a renaming allows).
        tolerance: with ``previous``, a layer is left alone while its imbalance is within
            ``tolerance`` of what a fresh plan reaches (relative, 0.005 = 0.5%); above that,
            moves repair it, the layer with most tokens above its target first. A layer is
            never re-planned from scratch.
        polish: extra improving moves per layer for a fresh plan of a large layer that the
            valve chain cannot balance exactly (see RESULTS.md for what they cost); 0 keeps
            planning in milliseconds.
        backend: "numba" or "numpy" to force an implementation (default: automatic).

    Returns:
        A valid :class:`Placement` (by construction: it is not validated again; call
        ``validate()`` to check); the same inputs give the same placement in any process.
    """
    counts_TLE = None
    ndim = loads.ndim if hasattr(loads, "ndim") else np.ndim(loads)
    if ndim > 3:
        raise ValueError(f"loads must have shape [num_layers, num_experts] (or [num_experts], or "
                         f"[steps, num_layers, num_experts] for a window of per-step counts), "
                         f"got {ndim} dimensions")
    if ndim == 3:
        if spread is not None:
            raise ValueError("loads is already the per-step counts [T, L, E]; drop spread=, or "
                             "pass the mean [L, E] as loads with spread=")
        arr = to_numpy(loads, "loads")
        if min(arr.shape) < 1:
            raise ValueError(f"loads [steps, num_layers, num_experts] needs at least one step, "
                             f"layer and expert, got shape {arr.shape}")
        spread = as_loads(arr.reshape(-1, arr.shape[2]), "loads").reshape(arr.shape)
        # the loads are the level of the steps that still describe them (all of them when
        # they held steady), and the window's steps are moved to that level
        loads, spread = steps.planning_window(spread)
    w = planning_loads(loads, topology)
    L, E = w.shape
    S = topology.num_slots
    if previous is not None:
        if not isinstance(previous, Placement):
            raise TypeError(f"previous must be a moebalance.Placement or None, got "
                            f"{type(previous).__name__}")
        if previous.phy2log.shape != (L, S) or previous.num_experts != E:
            raise ValueError(
                f"previous placement has shape {previous.phy2log.shape} for {previous.num_experts} "
                f"experts, but loads and topology need [{L}, {S}] for {E} experts; pass the "
                f"placement planned for this model and topology, or previous=None"
            )
        previous.validate(topology)
    if max_moves is not None:
        max_moves = integer(max_moves, "max_moves", 0)
        if previous is None:
            raise ValueError("max_moves bounds moves away from a previous placement: pass "
                             "previous=, or drop max_moves for a first placement")
    if move_cost is not None:
        if not isinstance(move_cost, MoveCost):
            raise TypeError(f"move_cost must be a moebalance.planner.MoveCost or None, got "
                            f"{type(move_cost).__name__}")
        if previous is None:
            raise ValueError("move_cost prices moves away from a previous placement: pass "
                             "previous=, or drop move_cost for a first placement")
    if spread is not None:
        counts_TLE = _spread(spread, w.shape)
    if not (0 <= float(tolerance) < 1):
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    polish = integer(polish, "polish", 0)
    if backend is not None and backend not in ("numba", "numpy"):
        raise ValueError(f"backend must be 'numba', 'numpy' or None, got {backend!r}")

    k = _jit.kernels(backend)
    phy2log, share = fresh.fresh(k, w, w, topology, int(polish))
    if counts_TLE is not None:
        phy2log, share = steps.best_for_steps(k, w, steps.sampled(counts_TLE), topology,
                                              (phy2log, share), previous, max_moves, move_cost,
                                              float(tolerance))
    elif previous is not None:
        phy2log, share = repair.repair(k, w, topology, previous, (phy2log, share), max_moves,
                                       move_cost, float(tolerance))
    # valid by construction (the tests validate every kind of plan): not validated again here
    return Placement(phy2log=phy2log, share=share, slot_device=topology.slot_device,
                     num_experts=E)


def _spread(spread, shape: tuple[int, int]) -> np.ndarray:
    """``spread`` checked: per-step counts [T, L, E] float64 matching loads of ``shape``."""
    arr = to_numpy(spread, "spread")
    if arr.ndim != 3 or arr.shape[1:] != shape or arr.shape[0] < 1:
        raise ValueError(f"spread must be the per-step counts [steps, {shape[0]}, {shape[1]}] "
                         f"of the window the loads average, got shape {arr.shape}")
    return np.ascontiguousarray(
        as_loads(arr.reshape(-1, shape[1]), "spread").reshape(arr.shape))


__all__ = ["MoveCost", "plan", "rebalance_experts", "resplit_device_loads"]
