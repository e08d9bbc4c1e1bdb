"""Re-plans onto a topology that lost or gained devices: survivors stay, lost experts are
restores."""

from __future__ import annotations

import numpy as np
import pytest

import moebalance as mb
from moebalance.planner.elastic import carry_over, replan_onto

LOADS = np.random.default_rng(0).random((3, 12)) + 0.2


def start(slots=(4, 4, 4, 4)):
    topo = mb.Topology.from_arrays(speed=[1.0] * len(slots), slots=list(slots))
    return topo, mb.plan(LOADS, topo)


def test_shrink_keeps_survivors_and_restores_what_only_the_lost_device_held():
    topo, old = start()
    three = mb.Topology.from_arrays(speed=[1.0, 1.0, 1.0], slots=[5, 5, 5])
    out = replan_onto(LOADS, three, old, device_map=[0, -1, 1, 2])
    out.placement.validate(three)
    for layer in range(3):
        lost = set(old.phy2log[layer, old.slot_device == 1].tolist())
        alive = set(old.phy2log[layer, old.slot_device != 1].tolist())
        assert {e for l, e in out.restores if l == layer} == lost - alive
        for old_g, new_g in ((0, 0), (2, 1), (3, 2)):   # carried before re-balancing
            assert set(old.phy2log[layer, old.slot_device == old_g]) <= set(
                out.carried.phy2log[layer, out.carried.slot_device == new_g])
    assert out.kept == 3 * 12
    after = mb.imbalance(LOADS, out.placement, three).max()
    assert after <= mb.imbalance(LOADS, out.carried, three).max() + 1e-9


def test_grow_fills_the_new_device_and_moves_few():
    topo, old = start()
    five = mb.Topology.from_arrays(speed=[1.0] * 5, slots=[4] * 5)
    out = replan_onto(LOADS, five, old, device_map=[0, 1, 2, 3])
    out.placement.validate(five)
    assert out.restores == [] and out.kept == 3 * 16
    assert out.moves <= 3 * 16 // 2      # survivors mostly stay


def test_max_moves_caps_copies_beyond_the_carried_placement():
    topo, old = start()
    three = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5], slots=[6, 6, 6])
    out = replan_onto(LOADS, three, old, device_map=[0, 1, -1, 2], max_moves=2)
    assert out.placement.moves_from(out.carried) <= 2


def test_bad_device_map_names_the_argument():
    topo, old = start()
    three = mb.Topology.from_arrays(speed=[1.0] * 3, slots=[5] * 3)
    with pytest.raises(ValueError, match="device_map"):
        carry_over(old, three, [0, 1, 2])
    with pytest.raises(ValueError, match="distinct new devices"):
        carry_over(old, three, [0, 0, 1, 2])
    with pytest.raises(ValueError, match="fewer than the 12 experts"):
        carry_over(old, mb.Topology.from_arrays(speed=[1.0] * 2, slots=[5, 5]), [0, 1, -1, -1])
