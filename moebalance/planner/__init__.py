"""plan(): replica counts, slot assignment and token shares for every MoE layer at once.

The algorithm lives in :mod:`moebalance.planner.algorithm` (plain Python, the reference) and
runs compiled by Numba when it is available (:func:`moebalance.backends`, part ``planner``).
"""

from __future__ import annotations

import numpy as np

from .._arrays import planning_loads
from ..backends import backend
from ..placement import Placement
from ..topology import Topology
from . import _jit, algorithm, eplb  # noqa: F401  (eplb registers its kernels before any compile)
from .eplb import rebalance_experts

# With a previous placement, moves go to a layer while its hottest device is more than this
# fraction above what a fresh plan reaches: moves are only spent where they buy real balance.
DEFAULT_TOLERANCE = 0.005
# Without a move budget, a layer that repair cannot bring within this fraction of a fresh plan
# takes the fresh plan, although that moves nearly all of its slots.
REBUILD_GAIN = 0.02
# Improving moves a fresh plan makes per layer when the layer is small enough to search
# exhaustively (slots x experts <= algorithm.EXHAUSTIVE_SIZE).
SMALL_LAYER_MOVES = 16


def _kernels(name: str | None = None):
    name = name or backend("planner")
    return _jit.compiled() if name == "numba" else _jit.interpreted()


def plan(loads, topology: Topology, previous: Placement | None = None,
         max_moves: int | None = None, *, tolerance: float = DEFAULT_TOLERANCE,
         polish: int = 0, backend: str | None = None) -> Placement:
    """Plan expert replicas, their devices and their token shares for every layer.

    Args:
        loads: [L, E] (or [E]) predicted tokens per logical expert; numpy, torch (CPU or CUDA)
            or cupy; finite and >= 0.
        topology: the devices (speed, slots, node); S = topology.num_slots >= E.
        previous: the placement in service now. Experts stay where they are unless moving them
            buys real balance; ``previous`` is not modified.
        max_moves: at most this many expert copies in total over all layers (needs
            ``previous``); None: no limit.
        tolerance: with ``previous``, a layer is left alone while its imbalance is within
            ``tolerance`` of what a fresh plan reaches (relative, 0.005 = 0.5%); above that,
            single moves repair it, worst layer first. Without ``max_moves``, a layer that
            repair leaves more than 2% above the fresh plan is re-planned from scratch.
        polish: extra improving moves per layer for a fresh plan of a large layer. Each costs
            about one share re-balance (measured, 58 layers x 256 experts on 320 slots: 16
            take imbalance from 1.014 to 1.006 and the plan from 4 ms to 60-85 ms); 0 keeps
            planning in milliseconds.
        backend: "numba" or "numpy" to force an implementation (default: automatic).

    Returns:
        A validated :class:`Placement`; the same inputs give the same placement in any process.
    """
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
        if isinstance(max_moves, bool) or int(max_moves) != max_moves or max_moves < 0:
            raise ValueError(f"max_moves must be an integer >= 0 or None, got {max_moves!r}")
        if previous is None:
            raise ValueError("max_moves bounds moves away from a previous placement: pass "
                             "previous=, or drop max_moves for a first placement")
    if not (0 <= float(tolerance) < 1):
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    if isinstance(polish, bool) or int(polish) != polish or polish < 0:
        raise ValueError(f"polish must be an integer >= 0, got {polish!r}")
    if backend is not None and backend not in ("numba", "numpy"):
        raise ValueError(f"backend must be 'numba', 'numpy' or None, got {backend!r}")

    k = _kernels(backend)
    # quicksort: the kernel puts equal loads in expert order, so the sort need not be stable
    order = np.argsort(-w, axis=1, kind="quicksort")
    args = (order, topology.speed, topology.slots, topology.node, topology.slot_offsets,
            topology.slot_device, _reserves(topology, E))
    phy2log, share = k.plan_fresh(w, *args, SMALL_LAYER_MOVES, int(polish), algorithm.MAX_SWEEPS)
    if previous is not None:
        ideal = w.sum(axis=1) / topology.speed.sum()
        fresh_time = _max_time(w, phy2log, share, topology)
        target = np.maximum(fresh_time, ideal) * (1.0 + float(tolerance))
        budget = -1 if max_moves is None else int(max_moves)
        kept_p, kept_s, _, _ = k.plan_repair(
            w, topology.speed, topology.slot_offsets, topology.slot_device,
            previous.phy2log, previous.share, target, budget, algorithm.MAX_SWEEPS)
        phy2log, share = kept_p, kept_s
    # valid by construction (the tests validate every kind of plan): not validated again here
    return Placement(phy2log=phy2log, share=share, slot_device=topology.slot_device,
                     num_experts=E)


def _reserves(topology: Topology, num_experts: int) -> np.ndarray:
    """[V, G] int64: the ways the valve chain tries to keep slots free of whole experts.

    One free slot on every device when S - E >= G (every device can take a valve), then the
    spare slots where whole experts in proportion to speed leave them (see
    :func:`_speed_reserve`); only the second when spare slots are fewer than devices.
    """
    key = (topology, num_experts)
    if key not in _RESERVES:
        G = topology.num_devices
        rows = []
        if topology.num_slots - num_experts >= G:
            rows.append(np.minimum(1, topology.slots))
        by_speed = _speed_reserve(topology, num_experts)
        if not any(np.array_equal(by_speed, r) for r in rows):
            rows.append(by_speed)
        if len(_RESERVES) > 64:
            _RESERVES.clear()
        _RESERVES[key] = np.ascontiguousarray(np.stack(rows), dtype=np.int64)
    return _RESERVES[key]


_RESERVES: dict = {}


def _speed_reserve(topology: Topology, num_experts: int) -> np.ndarray:
    """[G] int64: free slots per device when whole experts are spread in proportion to speed
    (at most a device's slots; largest remainders round)."""
    speed = topology.speed
    slots = topology.slots.astype(np.float64)
    E = num_experts
    # water level lam: sum_g min(slots_g, lam * speed_g) = E
    lo, hi = 0.0, float(slots.max() / speed.min())
    for _ in range(60):
        lam = 0.5 * (lo + hi)
        if np.minimum(slots, lam * speed).sum() < E:
            lo = lam
        else:
            hi = lam
    share = np.minimum(slots, hi * speed)
    whole = np.floor(share + 1e-9).astype(np.int64)
    short = E - int(whole.sum())
    if short > 0:
        rest = np.where(whole < topology.slots, share - whole, -1.0)
        whole[np.argsort(-rest, kind="stable")[:short]] += 1
    return topology.slots - whole


def _max_time(w, phy2log, share, topology: Topology) -> np.ndarray:
    """[L] hottest device time of each layer."""
    slot_load = np.take_along_axis(w, phy2log, axis=1) * share
    G = topology.num_devices
    loads = np.zeros((w.shape[0], G))
    for layer in range(w.shape[0]):
        loads[layer] = np.bincount(topology.slot_device, weights=slot_load[layer], minlength=G)
    return (loads / topology.speed).max(axis=1)


__all__ = ["plan", "rebalance_experts"]
