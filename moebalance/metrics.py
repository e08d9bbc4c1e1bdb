"""How evenly a placement spreads the tokens, per layer and as one summary.

A device's load is the sum, over its slots, of the slot's expert's tokens times the slot's share;
its time is load / speed. **imbalance** is the slowest device's time over the ideal time (all
tokens over all speed): 1.0 is perfect. **balancedness** is EPLB's mean/max device load, blind to
speed. Over several layers, which run one after another, the summary is
``sum_l max_g(load/speed) / sum_l ideal``. The **per-step imbalance** (each step's own counts,
re-split over the replicas as the dispatcher does) is :func:`moebalance.step_imbalance`, beside
the re-split in :mod:`moebalance.dispatch.shares` (above this ground-floor module).
"""

from __future__ import annotations

import numpy as np

from ._check import as_loads
from .placement import Placement
from .topology import Topology


def _device_times(loads, placement: Placement, topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a moebalance.Topology, got {type(topology).__name__}")
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a moebalance.Placement, got {type(placement).__name__}")
    if placement.num_slots != topology.num_slots or not np.array_equal(
        placement.slot_device, topology.slot_device
    ):
        raise ValueError("placement does not match topology: plan it for this topology")
    w = as_loads(loads, "loads", placement.num_experts)
    load = placement.device_loads(w)  # [L, G]
    return w, load


def imbalance(loads, placement: Placement, topology: Topology) -> np.ndarray:
    """[L] float64: ``max_g(load[g]/speed[g]) / (sum(w) / sum(speed))``; 1.0 is perfect.

    A layer with no load at all counts as perfectly balanced (1.0).
    """
    w, load = _device_times(loads, placement, topology)
    ideal = w.sum(axis=1) / topology.speed.sum()
    worst = (load / topology.speed).max(axis=1)
    return np.where(ideal > 0, worst / np.where(ideal > 0, ideal, 1.0), 1.0)


def balancedness(loads, placement: Placement, topology: Topology) -> np.ndarray:
    """[L] float64: mean over devices of load / max device load (EPLB's figure; 1.0 is perfect)."""
    _, load = _device_times(loads, placement, topology)
    peak = load.max(axis=1)
    return np.where(peak > 0, load.mean(axis=1) / np.where(peak > 0, peak, 1.0), 1.0)


def summary_imbalance(loads, placement: Placement, topology: Topology) -> float:
    """``sum_l max_g(load/speed) / sum_l ideal``: layers run in turn, so their times add."""
    w, load = _device_times(loads, placement, topology)
    ideal = (w.sum(axis=1) / topology.speed.sum()).sum()
    worst = (load / topology.speed).max(axis=1).sum()
    return float(worst / ideal) if ideal > 0 else 1.0
