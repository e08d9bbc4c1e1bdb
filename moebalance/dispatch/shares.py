"""Per-step re-split: this step's token shares over the replicas a placement already has.

A placement is planned on a window's mean load; each step's own counts differ from it. Given the
layer's live pairs per expert ``w_E`` (summed from the counts exchange) and the devices' speeds,
:func:`resplit_shares` chooses the shares of every replicated expert so as to minimise the
slowest device's time ``max_g load_g / speed_g`` with ``load_g = sum over g's replicas of
w[e] * share``, without moving any weight.

Method: the planner's share step (``balance_shares`` in :mod:`moebalance.planner.algorithm`):
each replicated expert in turn is water-filled (its pairs poured onto its devices so that those
that receive any finish together, given everything else they hold). That minimises
``sum_g load_g**2 / speed_g``, whose minimiser also minimises the maximum. Here the experts are
grouped into colour classes, no two experts of a class sharing a device, so one water-filling
of a whole class is a handful of torch ops on the counts' device (Gauss-Seidel by blocks); a
fixed number of sweeps over the classes needs no host sync. The loop runs over colour classes
(at most the most replicated experts any device holds, plus a few), never over experts.

Legend: G devices (ranks), E logical experts, X most replicas of an expert, C colour classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .routing import ReplicaTable

__all__ = ["RESPLIT_SWEEPS", "ColourClass", "ResplitPlan", "resplit_plan", "resplit_shares", "device_loads",
           "optimal_max_time"]

# Sweeps over all colour classes per step (see benchmarks/RESULTS.md for how close this gets to
# the per-step optimum).
RESPLIT_SWEEPS = 4


@dataclass(frozen=True)
class ColourClass:
    """Replicated experts of which no two share a device, with what their water-filling reads.

    Attributes (n experts of the class):
        experts: [n] int64 expert ids.
        valid: [n, X] bool, columns holding a replica.
        device: [n, X] int64, device of each replica (0 on padding, so it can index).
        scatter: [n, X] int64, device of each replica (G, a scratch cell, on padding).
        rate: [n, X] float64, speed of each replica's device (1 on padding).
    """

    experts: torch.Tensor
    valid: torch.Tensor
    device: torch.Tensor
    scatter: torch.Tensor
    rate: torch.Tensor


@dataclass(frozen=True)
class ResplitPlan:
    """What the re-split of one layer needs besides the counts, on one device.

    Attributes:
        holds_GEX: [G, E, X] float64, 1 where device g holds replica (e, j).
        classes: C :class:`ColourClass` covering the replicated experts.
    """

    holds_GEX: torch.Tensor
    classes: tuple


def _colour_classes(device_EX: np.ndarray, num_devices: int) -> list[np.ndarray]:
    """Greedy colouring of the experts with >= 2 replicas: an expert joins the first class whose
    experts use none of its devices."""
    classes: list[list[int]] = []
    used: list[np.ndarray] = []
    for e in range(device_EX.shape[0]):
        devices = device_EX[e][device_EX[e] >= 0]
        if devices.size < 2:
            continue
        for c, taken in enumerate(used):
            if not taken[devices].any():
                classes[c].append(e)
                taken[devices] = True
                break
        else:
            taken = np.zeros(num_devices, dtype=bool)
            taken[devices] = True
            classes.append([e])
            used.append(taken)
    return [np.asarray(c, dtype=np.int64) for c in classes]


def resplit_plan(table: ReplicaTable, speed_G, device=None) -> ResplitPlan:
    """The :class:`ResplitPlan` of a layer.

    Args:
        table: the layer's :class:`~moebalance.dispatch.routing.ReplicaTable`.
        speed_G: [G] positive speeds of the devices (array-like).
        device: where the plan's tensors live (default CPU).
    """
    speed = np.array(speed_G, dtype=np.float64)
    if speed.ndim != 1 or not np.all(np.isfinite(speed)) or not np.all(speed > 0):
        raise ValueError(f"speed_G must be a 1-D array of finite speeds > 0, got {speed_G!r}")
    device_EX = table.device_EX.cpu().numpy()
    G = speed.shape[0]
    if device_EX.max() >= G:
        raise ValueError(f"speed_G gives {G} devices but the placement uses device "
                         f"{int(device_EX.max())}; give one speed per rank of the group")
    holds = (device_EX[None] == np.arange(G)[:, None, None]).astype(np.float64)
    classes = []
    for experts in _colour_classes(device_EX, G):
        on = device_EX[experts]
        valid = on >= 0
        parts = (experts, valid, np.where(valid, on, 0), np.where(valid, on, G),
                 np.where(valid, speed[np.maximum(on, 0)], 1.0))
        classes.append(ColourClass(*(torch.from_numpy(np.ascontiguousarray(a)).to(device)
                                     for a in parts)))
    return ResplitPlan(torch.from_numpy(holds).to(device), tuple(classes))


def device_loads(w_E: torch.Tensor, share_EX: torch.Tensor, holds_GEX: torch.Tensor) -> torch.Tensor:
    """[G] float64 load of each device: sum over its replicas of w[e] * share[e, j].

    A dense reduction rather than a scatter-add: the same sum in the same order on every rank
    (float atomics on a GPU would not be)."""
    return (holds_GEX * (w_E.unsqueeze(1) * share_EX).unsqueeze(0)).sum(dim=(1, 2))


def _water_fill(c: ColourClass, w_n1: torch.Tensor, share_EX: torch.Tensor,
                load_G1: torch.Tensor) -> None:
    """Water-fill the experts of one colour class at once (``w_n1`` [n, 1] their loads);
    updates share_EX and load_G1 (its last entry a scratch cell for padding) in place."""
    share = share_EX.index_select(0, c.experts)
    base = torch.where(c.valid, load_G1[c.device] - w_n1 * share, 0.0)  # load without this expert
    level = torch.where(c.valid, base / c.rate, torch.inf)
    level_sorted, order = torch.sort(level, dim=1, stable=True)
    acc_base = torch.cumsum(base.gather(1, order), dim=1)
    acc_rate = torch.cumsum(c.rate.gather(1, order), dim=1)
    lam = (w_n1 + acc_base) / acc_rate                                  # [n, X] candidate levels
    following = torch.cat([level_sorted[:, 1:], torch.full_like(level_sorted[:, :1], torch.inf)], 1)
    # The level settles at the first k whose common time does not reach the next device's.
    k = (lam <= following).to(torch.int8).argmax(dim=1, keepdim=True)
    piece = torch.where(c.valid, (lam.gather(1, k) * c.rate - base).clamp(min=0.0), 0.0)
    placed = piece.sum(dim=1, keepdim=True)
    new_share = torch.where(placed > 0, piece / torch.where(placed > 0, placed, 1.0), share)
    share_EX.index_copy_(0, c.experts, new_share)
    load_G1.index_put_((c.scatter,), base + w_n1 * new_share)


def resplit_shares(w_E: torch.Tensor, share_EX: torch.Tensor, plan: ResplitPlan,
                   sweeps: int = RESPLIT_SWEEPS) -> torch.Tensor:
    """This step's shares: the water-filling of the module docstring, from ``share_EX``.

    Args:
        w_E: [E] pairs (or any non-negative load) of each expert this step, on plan's device.
        share_EX: [E, X] float64, starting shares (the placement's), rows summing to 1.
        plan: the layer's :class:`ResplitPlan`.
        sweeps: passes over every colour class.

    Returns:
        share_EX: [E, X] float64, new shares (rows sum to 1, zero on padding; experts with one
        replica, or no pairs, keep theirs).
    """
    w = w_E.to(torch.float64)
    share = share_EX.to(torch.float64).clone()
    load = device_loads(w, share, plan.holds_GEX)
    load_G1 = torch.cat([load, load.new_zeros(1)])
    w_n1 = [w.index_select(0, c.experts).unsqueeze(1) for c in plan.classes]
    for _ in range(sweeps if plan.classes else 0):
        for c, w_c in zip(plan.classes, w_n1):
            _water_fill(c, w_c, share, load_G1)
    return share


def optimal_max_time(w_E, phy2log_S, slot_device_S, speed_G) -> float:
    """The reference optimum of the re-split: min over shares of ``max_g load_g / speed_g``.

    A linear program (``scipy.optimize.linprog``, HiGHS): variables x_s >= 0, the pairs of slot
    s, and the time t; minimise t subject to ``sum of x over each expert's slots = w[e]`` and
    ``sum of x over device g's slots <= t * speed[g]``.

    Args:
        w_E: [E] loads of the layer. phy2log_S: [S] expert of each slot. slot_device_S: [S]
        device of each slot. speed_G: [G] device speeds.
    """
    from scipy.optimize import linprog

    w = np.asarray(w_E, dtype=np.float64)
    phy2log, device = np.asarray(phy2log_S), np.asarray(slot_device_S)
    speed = np.asarray(speed_G, dtype=np.float64)
    S, G, E = phy2log.shape[0], speed.shape[0], w.shape[0]
    cost = np.zeros(S + 1)
    cost[-1] = 1.0
    a_eq = np.zeros((E, S + 1))
    a_eq[phy2log, np.arange(S)] = 1.0
    a_ub = np.zeros((G, S + 1))
    a_ub[device, np.arange(S)] = 1.0
    a_ub[:, -1] = -speed
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(G), A_eq=a_eq, b_eq=w, bounds=(0, None),
                  method="highs")
    if not res.success:
        raise RuntimeError(f"the re-split LP failed: {res.message}")
    return float(res.x[-1])
