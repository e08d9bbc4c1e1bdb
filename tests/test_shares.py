"""Per-step re-split: the dispatcher's re-split over existing replicas reaches the planner's share
step and the LP optimum of the slowest device's time, keeps valid shares, and runs by classes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import placement_cases

from moebalance import Placement, Topology
from moebalance.dispatch.routing import replica_table
from moebalance.dispatch.shares import (
    RESPLIT_SWEEPS,
    _colour_classes,
    device_loads,
    optimal_max_time,
    resplit_plan,
    resplit_shares,
)
from moebalance.planner import _jit
from moebalance.planner.core import devices_of


def _slot_shares(table, share_EX: torch.Tensor, num_slots: int) -> np.ndarray:
    """[S] shares of the slots from [E, X] shares of the replica columns."""
    valid = table.valid_EX.numpy()
    out = np.zeros(num_slots)
    out[table.slots_EX.numpy()[valid]] = share_EX.numpy()[valid]
    return out


def _planner_max_time(w_E, placement: Placement, layer: int, speed_G) -> float:
    """The planner's own share step (balance_shares) from the placement's shares."""
    k = _jit.kernels("numba")
    phy2log = placement.phy2log[layer].copy()     # writable, as the planner hands it over
    share = placement.share[layer].copy()
    speed = np.asarray(speed_G, dtype=np.float64)
    slots = np.bincount(placement.slot_device, minlength=len(speed))
    dev = devices_of(Topology.from_arrays(speed, slots))
    load = k.device_loads(w_E, dev, phy2log, share)
    k.balance_shares(w_E, dev, phy2log, share, load, 1000)
    return float(np.max(load / speed))


def _ours(w_E, placement: Placement, layer: int, speed_G, sweeps: int):
    table = replica_table(placement, layer)
    plan = resplit_plan(table, speed_G)
    share = resplit_shares(torch.from_numpy(w_E), table.share_EX, plan, sweeps=sweeps)
    load = device_loads(torch.from_numpy(w_E), share, plan.holds_GEX).numpy()
    return table, share, float(np.max(load / np.asarray(speed_G)))


@settings(max_examples=40, deadline=None)
@given(placement_cases(max_devices=6, max_slots=4, max_layers=1), st.integers(0, 10**6))
def test_resplit_reaches_the_planner_share_step_and_the_lp_optimum(case, seed):
    p, topo = case.placement, case.topology
    gen = np.random.default_rng(seed)
    w = gen.integers(0, 5000, p.num_experts).astype(np.float64)
    if w.sum() == 0:
        w[0] = 1.0
    speed = topo.speed
    _, _, ours = _ours(w, p, 0, speed, sweeps=400)
    best = optimal_max_time(w, p.phy2log[0], p.slot_device, speed)
    planner = _planner_max_time(w, p, 0, speed)
    assert ours == pytest.approx(best, rel=1e-5, abs=1e-6)
    assert ours == pytest.approx(planner, rel=1e-4, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(placement_cases(max_devices=6, max_slots=4, max_layers=1), st.integers(0, 10**6))
def test_resplit_shares_are_valid_and_only_replicated_experts_change(case, seed):
    p, topo = case.placement, case.topology
    w = np.random.default_rng(seed).integers(0, 5000, p.num_experts).astype(np.float64)
    table, share, _ = _ours(w, p, 0, topo.speed, sweeps=RESPLIT_SWEEPS)
    valid = table.valid_EX
    assert bool((share >= 0).all()) and bool((share[~valid] == 0).all())
    torch.testing.assert_close(share.sum(dim=1), torch.ones(p.num_experts, dtype=torch.float64))
    single = valid.sum(dim=1) == 1
    assert torch.equal(share[single], table.share_EX[single])
    idle = torch.from_numpy(w == 0)
    assert torch.equal(share[idle], table.share_EX[idle])
    Placement(p.phy2log, _slot_shares(table, share, p.num_slots)[None], p.slot_device,
              p.num_experts).validate(topo)


def test_colour_classes_never_put_two_experts_of_one_device_together():
    gen = np.random.default_rng(5)
    device_EX = np.full((40, 4), -1)
    for e in range(40):
        n = gen.integers(1, 5)
        device_EX[e, :n] = gen.choice(12, n, replace=False)
    classes = _colour_classes(device_EX, 12)
    members = np.concatenate(classes)
    assert sorted(members.tolist()) == [e for e in range(40) if (device_EX[e] >= 0).sum() >= 2]
    for c in classes:
        devices = device_EX[c][device_EX[c] >= 0]
        assert devices.size == np.unique(devices).size


def test_resplit_moves_pairs_to_the_faster_device():
    # One expert on two devices of speeds 1 and 3, another expert alone on device 0.
    p = Placement(np.array([[0, 1, 0]]), np.array([[0.5, 1.0, 0.5]]), np.array([0, 0, 1]),
                  2).validate()
    table = replica_table(p, 0)
    plan = resplit_plan(table, [1.0, 3.0])
    share = resplit_shares(torch.tensor([800.0, 200.0]), table.share_EX, plan)
    # Both finish together: (200 + 800 a) / 1 = 800 (1 - a) / 3  ->  a = 0.0625 on device 0.
    np.testing.assert_allclose(share[0, :2].numpy(), [0.0625, 0.9375], rtol=1e-9)


@pytest.mark.parametrize("speed, error", [([1.0, 0.0], "speed_G"), ([1.0], "speed_G"),
                                          ([[1.0, 2.0]], "speed_G")])
def test_bad_speeds_raise_naming_them(speed, error):
    p = Placement(np.array([[0, 1, 0]]), np.array([[0.5, 1.0, 0.5]]), np.array([0, 0, 1]), 2)
    with pytest.raises(ValueError, match=error):
        resplit_plan(replica_table(p, 0), speed)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_pair_fill_finishes_both_devices_together_or_leaves_the_hotter_empty(rng, backend):
    """The water filling's two-replica step: every token placed, shares summing to 1, and the
    two devices finishing together, or all tokens on the one that stays at or below the
    other's time without them (the optimum for two devices)."""
    k = _jit.kernels(backend)
    for _ in range(200):
        speed = rng.uniform(0.2, 3.0, 2)
        slot_device = np.array([0, 1], dtype=np.int64)
        speed.flags.writeable = slot_device.flags.writeable = False   # as the planner holds them
        share = rng.dirichlet([1.0, 1.0])
        we = float(rng.uniform(0.0, 100.0))
        other = rng.uniform(0.0, 100.0, 2) * (rng.random(2) < 0.8)
        load = other + we * share
        k.pair_fill(we, 0, 1, speed, slot_device, share, load)
        np.testing.assert_allclose(share.sum(), 1.0, rtol=1e-12)
        np.testing.assert_allclose(load, other + we * share, rtol=1e-12, atol=1e-9)
        t = load / speed
        if share.min() > 1e-12:
            np.testing.assert_allclose(t[0], t[1], rtol=1e-9)
        else:
            empty = int(np.argmin(share))
            assert t[1 - empty] <= other[empty] / speed[empty] * (1 + 1e-9) + 1e-12
