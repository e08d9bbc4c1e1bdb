"""plan(): replica counts, slot assignment and token shares for every MoE layer at once.

The algorithm lives in :mod:`moebalance.planner.algorithm` (plain Python, the reference) and
runs compiled by Numba when it is available (:func:`moebalance.backends`, part ``planner``).
Given a window of per-step counts ``[T, L, E]``, ``plan`` plans for the steps after the
per-step re-split (:mod:`moebalance.planner.steps`, whose docstring gives the rule: volatile
and large experts liquid on one ring of devices, so a step's excess can flow; the small calm
ones alone); :mod:`moebalance.planner.trigger` says when a re-plan's moves pay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._check import as_loads, to_numpy
from ..backends import backend
from ..placement import Placement
from ..topology import Topology, planning_loads
from . import _jit, algorithm, eplb, steps  # noqa: F401  (kernels register before any compile)
from .eplb import rebalance_experts

# With a previous placement, moves go to a layer while its hottest device is more than this
# fraction above what a fresh plan reaches: moves are only spent where they buy real balance.
DEFAULT_TOLERANCE = 0.005
# Improving moves a fresh plan makes per layer when the layer is small enough to search
# exhaustively (slots x experts <= algorithm.EXHAUSTIVE_SIZE).
SMALL_LAYER_MOVES = 16
# Steps of a window a plan for the steps is judged on (evenly spaced; all when fewer).
STEP_SAMPLES = 8
# Share sweeps of the re-split when judging candidates on those steps: they start from shares
# balanced for the mean, and a ranking needs less precision than the dispatcher's re-split.
JUDGE_SWEEPS = 4
# (spread_k, piece_cap) of the plans for the steps tried per layer (see .steps).
STEP_SETTINGS = ((1.0, 0.25),)


def resplit_device_loads(counts_TE, phy2log_S, share_S, topology: Topology,
                         backend: str | None = None) -> np.ndarray:
    """[T, G] device loads of one layer at every step of ``counts_TE`` [T, E] when each step's
    tokens are re-split over the replicas of ``phy2log_S`` / ``share_S`` [S] (water filling
    from those shares, as the dispatcher's per-step re-split does), with the planner's kernels
    (``backend`` as in :func:`plan`; default: :func:`moebalance.backends`)."""
    return _kernels(backend).resplit_device_loads(
        np.ascontiguousarray(counts_TE, dtype=np.float64), phy2log_S, share_S, topology.speed,
        topology.slot_device, algorithm.MAX_SWEEPS)


def _kernels(name: str | None = None):
    name = name or backend("planner")
    return _jit.compiled() if name == "numba" else _jit.interpreted()


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
            is then for the steps, as with ``spread`` (their mean is the predicted load);
            numpy, torch (CPU or CUDA) or cupy; finite and >= 0.
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
            ``STEP_SAMPLES`` of them, evenly spaced) earliest on average when each step's
            tokens are re-split over them. With ``previous`` a layer changes only when that
            figure improves by more than ``tolerance`` (and pays for its moves under
            ``move_cost``, fits ``max_moves``); its candidates are then the placement in
            service, its repair and the fresh plan.
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
    counts = None
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
        loads = spread.mean(axis=0)
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
    if move_cost is not None:
        if not isinstance(move_cost, MoveCost):
            raise TypeError(f"move_cost must be a moebalance.planner.MoveCost or None, got "
                            f"{type(move_cost).__name__}")
        if previous is None:
            raise ValueError("move_cost prices moves away from a previous placement: pass "
                             "previous=, or drop move_cost for a first placement")
    if spread is not None:
        counts = _spread(spread, w.shape)
    if not (0 <= float(tolerance) < 1):
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    if isinstance(polish, bool) or int(polish) != polish or polish < 0:
        raise ValueError(f"polish must be an integer >= 0, got {polish!r}")
    if backend is not None and backend not in ("numba", "numpy"):
        raise ValueError(f"backend must be 'numba', 'numpy' or None, got {backend!r}")

    k = _kernels(backend)
    phy2log, share = _fresh(k, w, w, topology, int(polish))
    if counts is not None:
        phy2log, share = _for_steps(k, w, _sampled(counts), topology, phy2log, share, previous,
                                    max_moves, move_cost, float(tolerance))
        return Placement(phy2log=phy2log, share=share, slot_device=topology.slot_device,
                         num_experts=E)
    if previous is not None:
        ideal = w.sum(axis=1) / topology.speed.sum()
        fresh_time = _max_time(w, phy2log, share, topology)
        target = np.maximum(fresh_time, ideal) * (1.0 + float(tolerance))
        budget = -1 if max_moves is None else int(max_moves)
        phy2log, share, kept_share, moves = k.plan_repair(
            w, topology.speed, topology.slot_offsets, topology.slot_device,
            previous.phy2log, previous.share, target, budget, algorithm.MAX_SWEEPS)
        if move_cost is not None:
            kept_time = _max_time(w, previous.phy2log, kept_share, topology)
            saved = (kept_time - _max_time(w, phy2log, share, topology)) / max(ideal.sum(), 1e-300)
            dear = (moves > 0) & (saved <= moves * move_cost.per_move)
            phy2log[dear] = previous.phy2log[dear]
            share[dear] = kept_share[dear]
    # valid by construction (the tests validate every kind of plan): not validated again here
    return Placement(phy2log=phy2log, share=share, slot_device=topology.slot_device,
                     num_experts=E)


def _fresh(k, w: np.ndarray, vol: np.ndarray, topology: Topology, polish: int):
    """The fresh-plan kernel for loads ``w`` [L, E], ring valves chosen by ``vol`` [L, E]."""
    # quicksort: the kernel puts equal loads in expert order, so the sort need not be stable
    order = np.argsort(-w, axis=1, kind="quicksort")
    return k.plan_fresh(w, order, np.ascontiguousarray(vol), topology.speed, topology.slots,
                        topology.node, topology.slot_offsets, topology.slot_device,
                        _reserves(topology, w.shape[1]), SMALL_LAYER_MOVES, polish,
                        algorithm.MAX_SWEEPS)


def _sampled(counts_TLE: np.ndarray) -> np.ndarray:
    """At most ``STEP_SAMPLES`` steps of the window, evenly spaced (all when fewer)."""
    T = counts_TLE.shape[0]
    if T <= STEP_SAMPLES:
        return counts_TLE
    return np.ascontiguousarray(counts_TLE[np.linspace(0, T - 1, STEP_SAMPLES).round().astype(int)])


def _step_times(k, counts_TLE, phy2log, share, topology: Topology) -> np.ndarray:
    """[L] mean hottest time over the steps of ``counts_TLE`` after the per-step re-split."""
    return k.step_times(counts_TLE, phy2log, share.copy(), topology.speed, topology.slot_device,
                        JUDGE_SWEEPS)


def _layer_moves(new_phy2log, old_phy2log, topology: Topology, num_experts: int) -> np.ndarray:
    """[L] expert copies each layer needs to go from ``old`` to ``new`` (a device's slots
    relabel freely)."""
    L = new_phy2log.shape[0]
    held = np.zeros((L, topology.num_devices * num_experts), dtype=bool)
    rows = np.arange(L)[:, None]
    held[rows, topology.slot_device * num_experts + old_phy2log] = True
    return (~held[rows, topology.slot_device * num_experts + new_phy2log]).sum(axis=1)


def _for_steps(k, w, counts_TLE, topology: Topology, phy2log, share, previous, max_moves,
               move_cost, tolerance):
    """Per layer, the candidate that serves the steps of ``counts_TLE`` best (see
    ``plan(spread=...)``); ``phy2log``/``share`` are the window-mean plan."""
    best_p, best_s = phy2log.copy(), share.copy()
    best_t = _step_times(k, counts_TLE, best_p, best_s, topology)
    std = counts_TLE.std(axis=0)
    for spread_k, piece_cap in STEP_SETTINGS:
        p, s = k.plan_steps(w, np.ascontiguousarray(w + spread_k * std), piece_cap,
                            topology.speed, topology.slots, topology.node, topology.slot_offsets,
                            topology.slot_device, algorithm.MAX_SWEEPS)
        t = _step_times(k, counts_TLE, p, s, topology)
        better = t < best_t * (1.0 - 1e-9)
        best_p[better], best_s[better], best_t[better] = p[better], s[better], t[better]
    if previous is None:
        return best_p, best_s
    E = w.shape[1]
    ideal = w.sum(axis=1) / topology.speed.sum()
    fresh_time = _max_time(w, phy2log, share, topology)
    target = np.maximum(fresh_time, ideal) * (1.0 + tolerance)
    budget = -1 if max_moves is None else int(max_moves)
    rep_p, rep_s, kept_s, rep_moves = k.plan_repair(
        w, topology.speed, topology.slot_offsets, topology.slot_device, previous.phy2log,
        previous.share, target, budget, algorithm.MAX_SWEEPS)
    # options per layer: 0 the placement in service (shares re-split), 1 its repair, 2 fresh
    opt_p = np.stack([previous.phy2log, rep_p, best_p])
    opt_s = np.stack([kept_s, rep_s, best_s])
    opt_t = np.stack([_step_times(k, counts_TLE, previous.phy2log, kept_s, topology),
                      _step_times(k, counts_TLE, rep_p, rep_s, topology), best_t])
    opt_m = np.stack([np.zeros_like(rep_moves), rep_moves,
                      _layer_moves(best_p, previous.phy2log, topology, E)])
    price = 0.0 if move_cost is None else move_cost.per_move
    # a change must beat the placement in service by the tolerance and pay for its moves
    saved = (opt_t[0] - opt_t) / max(ideal.sum(), 1e-300)
    worth = (opt_t <= opt_t[0] * (1.0 - tolerance)) & (saved > opt_m * price)
    worth[0] = True
    score = np.where(worth, opt_t, np.inf)
    choice = score.argmin(axis=0)
    L = w.shape[0]
    if max_moves is not None:
        # over the budget: fall back, layer by layer, where a move buys least
        while opt_m[choice, np.arange(L)].sum() > max_moves:
            gain = np.full(L, np.inf)
            for layer in np.flatnonzero(choice > 0):
                c = choice[layer]
                gain[layer] = (opt_t[c - 1, layer] - opt_t[c, layer]) / max(
                    opt_m[c, layer] - opt_m[c - 1, layer], 1)
            choice[int(gain.argmin())] -= 1
    rows = np.arange(L)
    return opt_p[choice, rows].copy(), opt_s[choice, rows].copy()


def _spread(spread, shape: tuple[int, int]) -> np.ndarray:
    """``spread`` checked: per-step counts [T, L, E] float64 matching loads of ``shape``."""
    arr = to_numpy(spread, "spread")
    if arr.ndim != 3 or arr.shape[1:] != shape or arr.shape[0] < 1:
        raise ValueError(f"spread must be the per-step counts [steps, {shape[0]}, {shape[1]}] "
                         f"of the window the loads average, got shape {arr.shape}")
    return np.ascontiguousarray(
        as_loads(arr.reshape(-1, shape[1]), "spread").reshape(arr.shape))


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


__all__ = ["MoveCost", "plan", "rebalance_experts", "resplit_device_loads"]
