"""Per-step re-split: this step's token shares over the replicas a placement already has.

A placement is planned on a window's mean load; each step's own counts differ from it. Given the
layer's live pairs per expert ``w_E`` (summed from the counts exchange) and the devices' speeds,
:func:`resplit_shares` chooses the shares of every replicated expert so as to minimise the
slowest device's time ``max_g load_g / speed_g`` with ``load_g = sum over g's replicas of
w[e] * share``, without moving any weight.

Method: water-filling sweeps over the replicated experts in colour-class order
(:mod:`.resplit_kernel`, which states it). Three forms compute it, chosen by
:func:`moebalance.backends.backend` ("resplit", device type):

- ``numba``: the kernel of :mod:`.resplit_kernel` compiled (CPU tensors; its plain-Python run is
  the reference the tests hold it to);
- ``cuda``: ``csrc/resplit.cu`` through CuPy (:mod:`.resplit_cuda`), one launch, no host sync;
- ``torch``: :func:`resplit_shares_torch` here, one water-filling of a whole colour class at
  a time in a handful of tensor ops on the counts' device (any device; the plain reference).
  It cannot stop early without a host sync, so it runs a fixed number of sweeps.

:func:`optimal_max_time` is the LP optimum every form is measured against.
:func:`step_imbalance` is DESIGN's per-step imbalance: each step's own counts, re-split so.

Legend: G devices (ranks), E logical experts, X most replicas of an expert, C colour classes,
V replicated experts, n experts of one colour class, Gs = G + 1 (the devices, then a scratch
cell for padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._check import as_loads, integer, to_numpy
from ..backends import backend, has_numba
from ..placement import Placement
from ..planner import _jit
from ..topology import Topology
from .resplit_kernel import RESPLIT_SWEEPS
from .routing import ReplicaTable

__all__ = ["RESPLIT_SWEEPS", "RESPLIT_TORCH_SWEEPS", "ColourClass", "step_imbalance",
           "ResplitPlan", "resplit_plan", "resplit_shares", "resplit_shares_torch",
           "device_loads", "optimal_max_time"]

# Sweeps of the torch form, which cannot stop early without a host sync.
RESPLIT_TORCH_SWEEPS = 4


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
        classes: C :class:`ColourClass` covering the replicated experts (the torch form).
        device_EX: [E, X] int64, device of each replica, -1 padded.
        speed_G: [G] float64, device speeds.
        order_V: [V] int64, the replicated experts in sweep order, class by class.
        class_starts_C1: [C + 1] int64, where each class starts in ``order_V`` (then V).
    """

    holds_GEX: torch.Tensor
    classes: tuple
    device_EX: torch.Tensor
    speed_G: torch.Tensor
    order_V: torch.Tensor
    class_starts_C1: torch.Tensor


def _kernels():
    """The re-split kernels: compiled where Numba is, else run as plain Python."""
    return _jit.kernels("numba" if has_numba() else "numpy")


def _colour_classes(device_EX: np.ndarray, num_devices: int) -> list[np.ndarray]:
    """The experts with >= 2 replicas in colour classes (:func:`.resplit_kernel.resplit_order`):
    no two experts of a class share a device."""
    order, starts = _kernels().resplit_order(np.ascontiguousarray(device_EX, dtype=np.int64),
                                             num_devices)
    return [order[starts[c]:starts[c + 1]] for c in range(starts.shape[0] - 1)]


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
    device_EX = np.ascontiguousarray(table.device_EX.cpu().numpy(), dtype=np.int64)
    G = speed.shape[0]
    if device_EX.max() >= G:
        raise ValueError(f"speed_G gives {G} devices but the placement uses device "
                         f"{int(device_EX.max())}; give one speed per rank of the group")
    holds = (device_EX[None] == np.arange(G)[:, None, None]).astype(np.float64)
    order, starts = _kernels().resplit_order(device_EX, G)
    classes = []
    for c in range(starts.shape[0] - 1):
        experts = order[starts[c]:starts[c + 1]]
        on = device_EX[experts]
        valid = on >= 0
        parts = (experts, valid, np.where(valid, on, 0), np.where(valid, on, G),
                 np.where(valid, speed[np.maximum(on, 0)], 1.0))
        classes.append(ColourClass(*(torch.from_numpy(np.ascontiguousarray(a)).to(device)
                                     for a in parts)))
    return ResplitPlan(*(torch.from_numpy(a).to(device) for a in (holds,)), tuple(classes),
                       *(torch.from_numpy(a).to(device) for a in (device_EX, speed, order,
                                                                  starts)))


def device_loads(w_E: torch.Tensor, share_EX: torch.Tensor,
                 holds_GEX: torch.Tensor) -> torch.Tensor:
    """[G] float64 load of each device: sum over its replicas of w[e] * share[e, j].

    A dense reduction rather than a scatter-add: the same sum in the same order on every rank
    (float atomics on a GPU would not be)."""
    return (holds_GEX * (w_E.unsqueeze(1) * share_EX).unsqueeze(0)).sum(dim=(1, 2))


def _water_fill(c: ColourClass, w_n: torch.Tensor, share_EX: torch.Tensor,
                load_Gs: torch.Tensor) -> None:
    """Water-fill the experts of one colour class at once (``w_n`` [n, 1]: their loads as a column);
    updates share_EX and load_Gs (its last entry a scratch cell for padding) in place."""
    share = share_EX.index_select(0, c.experts)
    base = torch.where(c.valid, load_Gs[c.device] - w_n * share, 0.0)  # load without this expert
    level = torch.where(c.valid, base / c.rate, torch.inf)
    level_sorted, order = torch.sort(level, dim=1, stable=True)
    acc_base = torch.cumsum(base.gather(1, order), dim=1)
    acc_rate = torch.cumsum(c.rate.gather(1, order), dim=1)
    lam = (w_n + acc_base) / acc_rate                                  # [n, X] candidate levels
    following = torch.cat([level_sorted[:, 1:], torch.full_like(level_sorted[:, :1], torch.inf)], 1)
    # The level settles at the first k whose common time does not reach the next device's.
    k = (lam <= following).to(torch.int8).argmax(dim=1, keepdim=True)
    piece = torch.where(c.valid, (lam.gather(1, k) * c.rate - base).clamp(min=0.0), 0.0)
    placed = piece.sum(dim=1, keepdim=True)
    new_share = torch.where(placed > 0, piece / torch.where(placed > 0, placed, 1.0), share)
    share_EX.index_copy_(0, c.experts, new_share)
    load_Gs.index_put_((c.scatter,), base + w_n * new_share)


def resplit_shares_torch(w_E: torch.Tensor, share_EX: torch.Tensor, plan: ResplitPlan,
                         sweeps: int = RESPLIT_TORCH_SWEEPS) -> torch.Tensor:
    """The torch form: ``sweeps`` sweeps of :mod:`.resplit_kernel` (classes forwards on even
    sweeps, backwards on odd ones), each class water-filled at once; no host sync.

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
    load_Gs = torch.cat([load, load.new_zeros(1)])
    w_n = [w.index_select(0, c.experts).unsqueeze(1) for c in plan.classes]
    forwards = list(zip(plan.classes, w_n))
    for sweep in range(sweeps if plan.classes else 0):
        for c, w_c in (forwards if sweep % 2 == 0 else forwards[::-1]):
            _water_fill(c, w_c, share, load_Gs)
    return share




def resplit_shares(w_E: torch.Tensor, share_EX: torch.Tensor, plan: ResplitPlan, *,
                   sweeps: int = RESPLIT_SWEEPS, exact: bool = True) -> torch.Tensor:
    """This step's shares, by the backend chosen for ``w_E``'s device (module docstring).

    Args:
        w_E: [E] pairs (or any non-negative load) of each expert this step, on plan's device.
        share_EX: [E, X] float64, starting shares (the placement's), rows summing to 1.
        plan: the layer's :class:`ResplitPlan`.
        sweeps, exact: water-filling sweeps, then the exact flow or not
            (:func:`.resplit_kernel.resplit_layer`); the torch form runs
            :data:`RESPLIT_TORCH_SWEEPS` sweeps and no flow whatever they say.

    Returns:
        share_EX: [E, X] float64 on ``w_E``'s device, new shares (rows sum to 1, zero on
        padding; experts with one replica, or no pairs, keep theirs).
    """
    sweeps = integer(sweeps, "sweeps", 0)
    name = backend("resplit", w_E.device.type)
    if name == "cuda" and w_E.device.type == "cuda":
        from .resplit_cuda import MAX_REPLICAS, resplit_shares_cuda

        # More replicas of one expert than the kernel's per-thread scratch holds: the torch
        # form below (every rank holds the same placement, so every rank takes it alike).
        if plan.device_EX.shape[1] <= MAX_REPLICAS:
            return resplit_shares_cuda(w_E, share_EX, plan, sweeps=sweeps, exact=exact)
    if name == "numba" and w_E.device.type == "cpu":
        share = share_EX.to(torch.float64, copy=True)
        load = torch.empty(plan.speed_G.shape[0], dtype=torch.float64)
        w = w_E.to(torch.float64).contiguous()
        _jit.kernels("numba").resplit_layer(w.numpy(), plan.device_EX.numpy(),
                                            plan.speed_G.numpy(), plan.order_V.numpy(),
                                            share.numpy(), load.numpy(), int(sweeps), bool(exact))
        return share
    return resplit_shares_torch(w_E, share_EX, plan)


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


def step_imbalance(counts_TLE, placement: Placement, topology: Topology, *, resplit: bool = True,
                   backend: str | None = None) -> np.ndarray:
    """[T] the per-step imbalance of ``placement`` on each step's own counts.

    Per step ``t`` of ``counts_TLE`` [T, L, E] (or [T, E] for one layer): ``sum_l max_g(load[g] /
    speed[g]) / sum_l ideal`` (DESIGN's summary over layers) on that step's counts, the figure
    that sets the step's time; its mean over the steps is the per-step imbalance the planner is
    judged by. With ``resplit`` (the default, what the dispatcher does) each step's tokens are
    re-split over the placement's replicas by the dispatcher's own kernel
    (:func:`.resplit_kernel.resplit_loads`: ``RESPLIT_SWEEPS`` water-filling sweeps, then the
    exact flow); without it every replica takes its planned share. A step with no tokens counts
    as 1.0. It lives beside the re-split, not in :mod:`moebalance.metrics` (the ground floor).
    ``backend``: "numba" or "numpy" to force the kernels' implementation.
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a moebalance.Placement, got "
                        f"{type(placement).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a moebalance.Topology, got {type(topology).__name__}")
    if placement.num_slots != topology.num_slots or not np.array_equal(
            placement.slot_device, topology.slot_device):
        raise ValueError("placement does not match topology: plan it for this topology")
    arr = to_numpy(counts_TLE, "counts_TLE")
    if arr.ndim == 2 and placement.num_layers == 1:
        arr = arr[:, None, :]
    if arr.ndim != 3 or arr.shape[1:] != (placement.num_layers, placement.num_experts):
        raise ValueError(f"counts_TLE must have shape [steps, {placement.num_layers}, "
                         f"{placement.num_experts}] (per-step counts of the placement's layers "
                         f"and experts), got {tuple(arr.shape)}")
    T, L, E = arr.shape
    w = as_loads(arr.reshape(T * L, E), "counts_TLE").reshape(T, L, E)
    speed = np.ascontiguousarray(topology.speed, dtype=np.float64)
    kernels = _jit.kernels(backend)
    if resplit:
        load_TLG = np.stack([kernels.resplit_loads(np.ascontiguousarray(w[:, layer]),
                                                   placement.phy2log[layer], placement.share[layer],
                                                   speed, placement.slot_device, RESPLIT_SWEEPS,
                                                   True)
                             for layer in range(L)], axis=1)
    else:
        load_TLG = np.stack([placement.device_loads(w[t]) for t in range(T)])
    worst_TL = (load_TLG / speed).max(axis=2)
    ideal_T = (w.sum(axis=2) / speed.sum()).sum(axis=1)
    return np.where(ideal_T > 0, worst_TL.sum(axis=1) / np.where(ideal_T > 0, ideal_T, 1.0), 1.0)
