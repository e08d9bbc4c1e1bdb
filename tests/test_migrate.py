"""plan_migration (numpy only): every changed slot gets one row from a holder, kept experts stay
put."""

from __future__ import annotations

import numpy as np
import pytest
from test_dispatcher_distributed import random_placement

import moebalance as mb
from moebalance.migrate import align_slots, plan_migration

SLOTS = [3, 4, 2, 3, 4]


def pair(seed: int, layers: int = 3, experts: int = 9):
    return (random_placement(seed, experts, SLOTS, num_layers=layers),
            random_placement(seed + 1000, experts, SLOTS, num_layers=layers))


def device_contents(p: mb.Placement, layer: int) -> list:
    return [sorted(zip(p.phy2log[layer, p.slot_device == g].tolist(),
                       p.share[layer, p.slot_device == g].tolist()))
            for g in range(p.num_devices)]


@pytest.mark.parametrize("seed", range(20))
def test_every_changed_slot_gets_one_row_from_a_holder(seed):
    old, new = pair(seed)
    plan = plan_migration(old, new)
    starts = np.searchsorted(old.slot_device, np.arange(old.num_devices + 1))
    changed = {(l, s) for l, s in zip(*np.nonzero(plan.target.phy2log != old.phy2log))}
    got = {(int(l), int(starts[d] + s)) for l, d,
           s in zip(plan.layer_M, plan.dst_rank_M, plan.dst_slot_M)}
    assert got == changed and len(got) == plan.layer_M.size
    for l, e, sr, ss in zip(plan.layer_M, plan.expert_M, plan.src_rank_M, plan.src_slot_M):
        assert old.phy2log[l, starts[sr] + ss] == e          # the source holds the expert now


@pytest.mark.parametrize("seed", range(20))
def test_target_is_new_relabelled_inside_devices_and_keeps_rows(seed):
    old, new = pair(seed)
    target = align_slots(old, new)
    for layer in range(old.num_layers):
        assert device_contents(target, layer) == device_contents(new, layer)
        for g in range(old.num_devices):
            mine = old.slot_device == g
            kept = set(old.phy2log[layer, mine]) & set(new.phy2log[layer, mine])
            for s in np.flatnonzero(mine):
                if old.phy2log[layer, s] in kept:
                    assert target.phy2log[layer, s] == old.phy2log[layer, s]
    assert plan_migration(old, new).num_moves == new.moves_from(old)


def _shares(row) -> np.ndarray:
    row = np.asarray(row)
    return np.array([1 / np.count_nonzero(row == e) for e in row])


def test_sources_prefer_own_node_then_the_least_busy_holder():
    # Expert 0 is held on devices 0 and 2; device 3 (node 1, beside device 2) needs it.
    slot_device = np.array([0, 0, 1, 1, 2, 2, 3, 3, 3])
    old_row, new_row = [0, 1, 2, 3, 0, 4, 5, 6, 1], [0, 1, 2, 3, 0, 4, 5, 6, 0]
    old = mb.Placement([old_row], [_shares(old_row)], slot_device, 7)
    new = mb.Placement([new_row], [_shares(new_row)], slot_device, 7)
    nodes = mb.Topology.from_arrays(speed=[1] * 4, slots=[2, 2, 2, 3], node=[0, 0, 1, 1])
    plan = plan_migration(old, new, nodes, expert_bytes=10)
    assert plan.src_rank_M.tolist() == [2] and plan.dst_rank_M.tolist() == [3]
    # Without nodes the two holders are equally far; the lower rank sends.
    assert plan_migration(old, new).src_rank_M.tolist() == [0]
    assert plan.sent_G.sum() == plan.received_G.sum() == 10 * plan.num_moves
    assert plan.sent_G.tolist() == [0, 0, 10, 0] and plan.received_G.tolist() == [0, 0, 0, 10]


def test_senders_share_the_work():
    # Expert 0 has replicas on devices 0..3; devices 4..7 all need it.
    slot_device = np.repeat(np.arange(8), [2, 2, 2, 2, 3, 3, 3, 3])
    old_row = [0, 1, 0, 2, 0, 3, 0, 4, 5, 6, 1, 7, 8, 2, 9, 10, 3, 11, 12, 4]
    new_row = [0, 1, 0, 2, 0, 3, 0, 4, 5, 6, 0, 7, 8, 0, 9, 10, 0, 11, 12, 0]
    old = mb.Placement([old_row], [_shares(old_row)], slot_device, 13)
    new = mb.Placement([new_row], [_shares(new_row)], slot_device, 13)
    plan = plan_migration(old, new)
    assert sorted(plan.src_rank_M.tolist()) == [0, 1, 2, 3]


def test_share_only_changes_are_changed_layers_without_moves():
    old, _ = pair(3)
    share = old.share.copy()
    row = old.phy2log[1]
    e = int(np.flatnonzero(np.bincount(row) > 1)[0])
    slots = np.flatnonzero(row == e)
    share[1, slots] = 0.0
    share[1, slots[0]] = 1.0
    new = mb.Placement(old.phy2log, share, old.slot_device, old.num_experts)
    plan = plan_migration(old, new)
    assert plan.changed_layers == (1,) and plan.num_moves == 0


def test_bad_input_names_the_argument():
    old, new = pair(0)
    other = random_placement(0, 9, [4, 4, 2, 3, 3], num_layers=3)
    with pytest.raises(ValueError, match="keeps each device's slots"):
        plan_migration(old, other)
    with pytest.raises(TypeError, match="new must be a moebalance.Placement"):
        plan_migration(old, "placement.npz")
    with pytest.raises(ValueError, match="expert_bytes"):
        plan_migration(old, new, expert_bytes=0)
    with pytest.raises(ValueError, match="topology has 2 devices"):
        plan_migration(old, new, mb.Topology.uniform(num_devices=2, slots_per_device=8))
