"""Placement: validity (DESIGN invariant 1), derived arrays, moves between placements, save/load,
and clear errors on bad input (invariant 7)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import placement_cases, placements, topologies

from moebalance import Device, Placement, Topology

# A small heterogeneous example used throughout: 3 devices with 2, 2 and 1 slots, 3 experts.
#   device 0: slots 0-1 hold experts 0, 1   device 1: slots 2-3 hold 2, 0   device 2: slot 4 holds 1
# Expert 0 splits 50/50 over slots 0 and 3, expert 1 25/75 over slots 1 and 4, expert 2 sits in slot
# 2.
TOPO = Topology([Device(1.0, 2, 0), Device(2.0, 2, 0), Device(0.5, 1, 1)])
PHY2LOG = [[0, 1, 2, 0, 1]]
SHARE = [[0.5, 0.25, 1.0, 0.5, 0.75]]


def example(phy2log=PHY2LOG, share=SHARE, slot_device=None, num_experts=3) -> Placement:
    slot_device = TOPO.slot_device if slot_device is None else slot_device
    return Placement(np.array(phy2log), np.array(share, dtype=np.float64), slot_device, num_experts)


def relabel_within_devices(p: Placement, perm_per_layer) -> Placement:
    """``p`` with the slots of every device permuted (``perm_per_layer[l]`` is an [S] permutation
    that only moves slots inside their device)."""
    phy2log = np.stack([p.phy2log[l, perm] for l, perm in enumerate(perm_per_layer)])
    share = np.stack([p.share[l, perm] for l, perm in enumerate(perm_per_layer)])
    return Placement(phy2log, share, p.slot_device, p.num_experts)


@st.composite
def within_device_permutations(draw, topology: Topology, num_layers: int):
    """[L] permutations of the slots that keep every slot on its device."""
    perms = []
    for _ in range(num_layers):
        perm = []
        for g in range(topology.num_devices):
            perm += draw(st.permutations(list(topology.device_slots(g))))
        perms.append(np.array(perm, dtype=np.int64))
    return perms


@st.composite
def placement_pairs(draw, count: int = 2):
    """A topology and ``count`` independent valid placements of one problem size on it."""
    topo = draw(topologies(max_devices=5, max_slots=4))
    num_layers = draw(st.integers(1, 3))
    num_experts = draw(st.integers(int(topo.slots.max()), topo.num_slots))
    return topo, [draw(placements(topo, num_layers, num_experts)) for _ in range(count)]


def brute_force_moves(new: Placement, old: Placement) -> int:
    """Per layer and device: experts held now that the device did not hold before."""
    total = 0
    for layer in range(new.num_layers):
        for g in range(new.num_devices):
            mine = new.slot_device == g
            total += len(set(new.phy2log[layer, mine].tolist())
                         - set(old.phy2log[layer, mine].tolist()))
    return total


# -- construction ----------------------------------------------------------------------------------

def test_constructor_normalises_dtypes_and_makes_arrays_read_only():
    p = Placement([[0, 1]], [[1, 1]], [0, 1], np.int64(2))
    assert p.phy2log.dtype == np.int64 and p.share.dtype == np.float64
    assert p.slot_device.dtype == np.int64 and type(p.num_experts) is int
    for arr in (p.phy2log, p.share, p.slot_device):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[..., 0] = 0


def test_sizes_follow_the_arrays():
    p = example()
    assert (p.num_layers, p.num_slots, p.num_devices, p.num_experts) == (1, 5, 3, 3)


def test_placement_does_not_alias_or_freeze_the_callers_arrays():
    buf = np.array([[0, 1, 2, 0, 1], [1, 0, 2, 1, 0]], dtype=np.int64)
    share = np.array(SHARE, dtype=np.float64)
    p = Placement(buf[:1], share, TOPO.slot_device, 3)
    assert share.flags.writeable, "the caller's share array was made read-only"
    buf[0, 0] = 2
    np.testing.assert_array_equal(p.phy2log, PHY2LOG)


@pytest.mark.parametrize("kwargs, message", [
    (dict(phy2log=[0, 1], share=[1.0, 1.0], slot_device=[0, 1]), r"phy2log must have shape"),
    (dict(phy2log=[[[0, 1]]], share=[[[1.0, 1.0]]], slot_device=[0, 1]),
     r"phy2log must have shape"),
    (dict(phy2log=[[0, 1]], share=[[1.0, 1.0, 1.0]], slot_device=[0, 1]),
     r"share must have the shape"),
    (dict(phy2log=[[0, 1]], share=[1.0, 1.0], slot_device=[0, 1]), r"share must have the shape"),
    (dict(phy2log=[[0, 1]], share=[[1.0, 1.0]], slot_device=[0, 1, 2]),
     r"slot_device must have shape"),
    (dict(phy2log=[[0, 1]], share=[[1.0, 1.0]], slot_device=[[0, 1]]),
     r"slot_device must have shape"),
])
def test_constructor_rejects_wrong_shapes_naming_the_array(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Placement(num_experts=2, **kwargs)


def test_constructor_rejects_fractional_expert_ids():
    with pytest.raises((TypeError, ValueError), match=r"phy2log"):
        Placement([[0.5, 1.7]], [[1.0, 1.0]], [0, 1], 2)


def test_constructor_rejects_fractional_num_experts():
    with pytest.raises((TypeError, ValueError), match=r"num_experts"):
        Placement([[0, 1]], [[1.0, 1.0]], [0, 1], 2.9)


# -- validate: invariant 1 -------------------------------------------------------------------------

def test_validate_accepts_the_example_and_returns_the_placement():
    p = example()
    assert p.validate() is p
    assert p.validate(TOPO) is p


@given(placement_cases())
def test_validate_accepts_every_valid_random_placement(case):
    assert case.placement.validate(case.topology) is case.placement
    assert case.placement.validate() is case.placement


@given(placement_cases(equal_shares=True))
def test_validate_accepts_equal_shares(case):
    case.placement.validate(case.topology)
    rep = case.placement.replicas
    for layer in range(case.placement.num_layers):
        np.testing.assert_allclose(case.placement.share[layer],
                                   1.0 / rep[layer, case.placement.phy2log[layer]])


def test_validate_accepts_zero_shares_and_rounding_within_tolerance():
    example(share=[[1.0, 0.0, 1.0, 0.0, 1.0]]).validate(TOPO)
    example(share=[[0.5 + 1e-12, 0.25, 1.0, 0.5, 0.75]]).validate(TOPO)


@pytest.mark.parametrize("changes, message", [
    (dict(phy2log=[[0, 1, 1, 0, 0]], share=[[1 / 3, 0.5, 0.5, 1 / 3, 1 / 3]]),
     r"expert 2 of layer 0 has no replica"),
    (dict(phy2log=[[0, 1, 2, 0, 3]]), r"phy2log\[0, 4\] = 3 is not an expert in \[0, 3\)"),
    (dict(phy2log=[[0, 1, 2, 0, -1]]), r"phy2log\[0, 4\] = -1 is not an expert"),
    (dict(share=[[0.5, 0.25, 1.0, 0.5, 0.5]]),
     r"shares of expert 1 in layer 0 sum to .*0\.75.*, not 1"),
    (dict(share=[[0.5, 0.25, 1.0, 0.5, 0.75 + 1e-6]]), r"shares of expert 1 in layer 0 sum to"),
    (dict(share=[[0.5, 0.25, 0.0, 0.5, 0.75]]), r"shares of expert 2 in layer 0 sum to .*0\.0"),
    (dict(share=[[1.5, 0.25, 1.0, -0.5, 0.75]]), r"share\[0, 3\] = -0\.5 must be >= 0"),
    (dict(share=[[0.5, 0.25, np.nan, 0.5, 0.75]]), r"share\[0, 2\] = nan"),
    (dict(share=[[0.5, 0.25, np.inf, 0.5, 0.75]]), r"share\[0, 2\] = inf"),
    (dict(num_experts=6), r"5 slots for 6 experts"),
    (dict(num_experts=0), r"num_experts must be >= 1"),
    (dict(slot_device=[0, 0, 1, 1, 0]), r"slot_device must number devices"),
    (dict(slot_device=[1, 1, 2, 2, 3]), r"slot_device must number devices"),
    (dict(slot_device=[0, 0, 2, 2, 3]), r"slot_device must number devices"),
])
def test_constructor_rejects_each_broken_content_rule_naming_it(changes, message):
    with pytest.raises(ValueError, match=message):
        example(**changes)


def test_doubled_shares_are_refused_at_construction_with_the_fix():
    p = example()
    with pytest.raises(ValueError,
                       match=r"share: .* sum to 2\.0, not 1; .*divide them by their sum"):
        Placement(p.phy2log, p.share * 2, p.slot_device, p.num_experts)


def test_validate_rejects_two_replicas_of_an_expert_on_one_device():
    p = example(phy2log=[[0, 0, 2, 1, 1]], share=[[0.5, 0.5, 1.0, 0.5, 0.5]])  # a valid Placement
    for topology in (None, TOPO):
        with pytest.raises(ValueError, match=r"device 0 holds expert 0 twice in layer 0"):
            p.validate(topology)


def test_share_sum_message_prints_a_plain_number():
    with pytest.raises(ValueError, match=r"sum to 0\.75, not 1"):
        example(share=[[0.5, 0.25, 1.0, 0.5, 0.5]])


def test_constructor_names_the_broken_layer():
    with pytest.raises(ValueError, match=r"expert 1 in layer 1"):
        example(phy2log=PHY2LOG * 2, share=[SHARE[0], [0.5, 0.25, 1.0, 0.5, 0.7]])


@pytest.mark.parametrize("topology", [
    Topology([Device(1.0, 2, 0), Device(2.0, 1, 0), Device(0.5, 2, 1)]),  # same S, other split
    Topology([Device(1.0, 2, 0), Device(2.0, 2, 0), Device(0.5, 2, 1)]),  # one slot more
    Topology([Device(1.0, 2, 0), Device(2.0, 2, 0)]),  # one device fewer
])
def test_validate_rejects_a_placement_for_another_topology(topology):
    with pytest.raises(ValueError, match=r"do not match the topology"):
        example().validate(topology)


@given(placement_cases(), st.data())
def test_constructor_rejects_a_random_placement_with_one_share_perturbed(case, data):
    p = case.placement
    layer = data.draw(st.integers(0, p.num_layers - 1))
    slot = data.draw(st.integers(0, p.num_slots - 1))
    share = p.share.copy()
    share[layer, slot] += data.draw(st.sampled_from([-2.0, 1e-6, 0.5]))
    with pytest.raises(ValueError, match=r"share"):
        Placement(p.phy2log, share, p.slot_device, p.num_experts)


@given(placement_cases(), st.data())
def test_constructor_rejects_a_random_placement_missing_an_expert(case, data):
    p = case.placement
    assume(p.num_experts >= 2)
    layer = data.draw(st.integers(0, p.num_layers - 1))
    gone = data.draw(st.integers(0, p.num_experts - 1))
    other = data.draw(st.integers(0, p.num_experts - 1).filter(lambda e: e != gone))
    # Hand every replica of ``gone`` to ``other``: ids stay in range, ``gone`` has no slot left.
    phy2log = p.phy2log.copy()
    phy2log[layer][phy2log[layer] == gone] = other
    with pytest.raises(ValueError, match=rf"expert {gone} of layer {layer} has no replica"):
        Placement(phy2log, p.share, p.slot_device, p.num_experts)


# -- replicas and log2phy --------------------------------------------------------------------------

def test_replicas_and_log2phy_of_the_example():
    p = example()
    np.testing.assert_array_equal(p.replicas, [[2, 2, 1]])
    np.testing.assert_array_equal(p.log2phy(), [[[0, 3], [1, 4], [2, -1]]])
    assert p.replicas.dtype == np.int64 and p.log2phy().dtype == np.int64


@given(placement_cases(max_devices=6, max_slots=4, max_layers=3))
def test_log2phy_lists_exactly_the_slots_of_each_expert_in_slot_order(case):
    p = case.placement
    rep, l2p = p.replicas, p.log2phy()
    assert rep.shape == (p.num_layers, p.num_experts)
    assert l2p.shape == (p.num_layers, p.num_experts, int(rep.max()))
    for layer in range(p.num_layers):
        assert rep[layer].sum() == p.num_slots
        for e in range(p.num_experts):
            slots = np.flatnonzero(p.phy2log[layer] == e)
            assert rep[layer, e] == len(slots)
            np.testing.assert_array_equal(l2p[layer, e, :len(slots)], slots)
            assert np.all(l2p[layer, e, len(slots):] == -1)
        listed = l2p[layer][l2p[layer] >= 0]
        np.testing.assert_array_equal(np.sort(listed), np.arange(p.num_slots))
        # phy2log inverts log2phy on every listed slot.
        experts = np.broadcast_to(np.arange(p.num_experts)[:, None], l2p[layer].shape)
        np.testing.assert_array_equal(p.phy2log[layer, l2p[layer][l2p[layer] >= 0]],
                                      experts[l2p[layer] >= 0])


def test_log2phy_of_single_replicas_has_width_one():
    p = Placement([[2, 0, 1]], [[1.0, 1.0, 1.0]], [0, 1, 2], 3)
    np.testing.assert_array_equal(p.log2phy(), [[[1], [2], [0]]])


def test_zero_layer_placement_has_an_empty_log2phy():
    p = Placement(np.zeros((0, 3), dtype=np.int64), np.zeros((0, 3)), [0, 0, 1], 2).validate()
    assert p.log2phy().shape == (0, 2, 1)


# -- device_loads ----------------------------------------------------------------------------------

def test_device_loads_of_the_example_by_hand():
    # slot loads: 4*.5, 2*.25, 6*1, 4*.5, 2*.75  ->  devices 2+.5, 6+2, 1.5
    np.testing.assert_allclose(example().device_loads([[4.0, 2.0, 6.0]]), [[2.5, 8.0, 1.5]])


def test_device_loads_take_one_dimensional_loads_as_one_layer():
    np.testing.assert_allclose(example().device_loads(np.array([4, 2, 6])), [[2.5, 8.0, 1.5]])


def test_device_loads_reject_loads_for_another_shape():
    with pytest.raises(ValueError, match=r"4 experts per layer but 3 were expected"):
        example().device_loads(np.ones((1, 4)))
    with pytest.raises(ValueError, match=r"loads has 2 layers but the placement has 1"):
        example().device_loads(np.ones((2, 3)))


# -- moves -----------------------------------------------------------------------------------------

def test_moves_from_itself_is_zero():
    assert example().moves_from(example()) == 0


def test_moves_from_none_counts_every_slot_of_every_layer():
    p = example(phy2log=PHY2LOG * 4, share=SHARE * 4)
    assert p.moves_from(None) == 4 * 5


def test_relabelling_slots_inside_a_device_is_free():
    # Device 0 swaps its two slots, device 1 too: same experts on every device.
    moved = example(phy2log=[[1, 0, 0, 2, 1]], share=[[0.25, 0.5, 0.5, 1.0, 0.75]])
    assert moved.moves_from(example()) == 0
    assert example().moves_from(moved) == 0


def test_changing_only_shares_moves_nothing():
    assert example(share=[[0.9, 0.5, 1.0, 0.1, 0.5]]).moves_from(example()) == 0


def test_swapping_experts_between_devices_counts_each_copy_received():
    # Expert 1 (device 0) and expert 2 (device 1) trade places: each device receives one copy.
    swapped = example(phy2log=[[0, 2, 1, 0, 1]], share=[[0.5, 1.0, 0.25, 0.5, 0.75]])
    swapped.validate(TOPO)
    assert swapped.moves_from(example()) == 2
    np.testing.assert_array_equal(swapped.moves_per_layer(example()), [2])


def test_replacing_one_replica_is_one_move():
    # Device 2 drops its replica of expert 1 and takes a second replica of expert 2.
    new = example(phy2log=[[0, 1, 2, 0, 2]], share=[[0.5, 1.0, 0.5, 0.5, 0.5]]).validate(TOPO)
    assert new.moves_from(example()) == 1


def test_moves_per_layer_counts_each_layer():
    old = example(phy2log=PHY2LOG * 3, share=SHARE * 3)
    new = example(phy2log=[[0, 1, 2, 0, 1], [0, 2, 1, 0, 1], [0, 1, 2, 0, 2]],
                  share=[SHARE[0], [0.5, 1.0, 0.25, 0.5, 0.75], [0.5, 1.0, 0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(new.moves_per_layer(old), [0, 2, 1])
    assert new.moves_per_layer(old).dtype == np.int64
    assert new.moves_from(old) == 3


@given(placement_pairs())
def test_moves_match_a_brute_force_count(pair):
    _, (a, b) = pair
    assert a.moves_from(b) == brute_force_moves(a, b)
    assert a.moves_from(b) == int(a.moves_per_layer(b).sum())


@given(placement_pairs())
def test_moves_are_symmetric_and_bounded_by_all_slots(pair):
    # Every device holds as many distinct experts before as after, so what it gains equals
    # what it loses.
    _, (a, b) = pair
    assert a.moves_from(b) == b.moves_from(a)
    np.testing.assert_array_equal(a.moves_per_layer(b), b.moves_per_layer(a))
    assert 0 <= a.moves_from(b) <= a.moves_from(None) == a.num_layers * a.num_slots


@given(placement_pairs(count=3))
def test_moves_obey_the_triangle_inequality(triple):
    _, (a, b, c) = triple
    assert c.moves_from(a) <= b.moves_from(a) + c.moves_from(b)


@given(st.data())
def test_moves_ignore_any_relabelling_inside_devices(data):
    case = data.draw(placement_cases())
    perms = data.draw(within_device_permutations(case.topology, case.placement.num_layers))
    relabelled = relabel_within_devices(case.placement, perms).validate(case.topology)
    assert relabelled.moves_from(case.placement) == 0
    assert case.placement.moves_from(relabelled) == 0


def test_moves_from_leaves_both_placements_unchanged():
    old, new = example(), example(phy2log=[[0, 2, 1, 0, 1]], share=[[0.5, 1.0, 0.25, 0.5, 0.75]])
    new.moves_from(old)
    assert old == example() and new == example(phy2log=[[0, 2, 1, 0, 1]],
                                                share=[[0.5, 1.0, 0.25, 0.5, 0.75]])


@pytest.mark.parametrize("previous", [
    example(phy2log=PHY2LOG * 2, share=SHARE * 2),  # more layers
    Placement([[0, 1, 2, 0]], [[0.5, 1.0, 1.0, 0.5]], [0, 0, 1, 1], 3),  # fewer slots
    Placement([[0, 1, 2, 0, 1]], [SHARE[0]], [0, 1, 1, 2, 2], 3),  # same S, other devices
    example(phy2log=[[0, 1, 2, 3, 1]], share=[[1.0, 0.25, 1.0, 1.0, 0.75]], num_experts=4),
])
def test_moves_from_a_placement_of_another_shape_raises(previous):
    with pytest.raises(ValueError, match=r"previous placement has shape"):
        example().moves_from(previous)
    with pytest.raises(ValueError, match=r"previous placement has shape"):
        example().moves_per_layer(previous)


@pytest.mark.parametrize("previous", [PHY2LOG, np.array(PHY2LOG), "placement.npz"])
def test_moves_from_a_non_placement_raises_type_error(previous):
    with pytest.raises(TypeError, match=r"previous must be a Placement"):
        example().moves_from(previous)


# -- save / load -----------------------------------------------------------------------------------

def test_save_load_round_trip(tmp_path):
    p = example(phy2log=PHY2LOG * 2, share=SHARE * 2)
    p.save(tmp_path / "placement.npz")
    q = Placement.load(tmp_path / "placement.npz")
    assert q == p and q.validate(TOPO) is q
    assert q.phy2log.dtype == np.int64 and q.share.dtype == np.float64
    assert not q.phy2log.flags.writeable and type(q.num_experts) is int


def test_save_load_accepts_str_paths(tmp_path):
    path = str(tmp_path / "p.npz")
    example().save(path)
    assert Placement.load(path) == example()


def test_save_adds_the_npz_suffix(tmp_path):
    example().save(tmp_path / "placement")
    assert (tmp_path / "placement.npz").exists()
    assert Placement.load(tmp_path / "placement.npz") == example()


def test_load_finds_what_save_wrote_under_the_same_path(tmp_path):
    example().save(tmp_path / "placement")
    assert Placement.load(tmp_path / "placement") == example()


@given(placement_cases(max_devices=5, max_layers=3))
def test_save_load_round_trip_of_random_placements_is_exact(case):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.npz"
        case.placement.save(path)
        loaded = Placement.load(path)
    assert loaded == case.placement
    assert loaded.moves_from(case.placement) == 0


def test_a_placement_saved_with_its_topology_loads_with_it(tmp_path):
    example().save(tmp_path / "p.npz", topology=TOPO)
    placement, topology = Placement.load_with_topology(tmp_path / "p.npz")
    assert placement == example() and topology == TOPO
    assert Placement.load(tmp_path / "p.npz") == example()  # load() still returns the placement


def test_a_placement_saved_without_a_topology_loads_with_none(tmp_path):
    example().save(tmp_path / "p.npz")
    assert Placement.load_with_topology(tmp_path / "p")[1] is None


def test_save_refuses_a_topology_with_other_slots(tmp_path):
    with pytest.raises(ValueError, match=r"do not match the topology"):
        example().save(tmp_path / "p.npz", topology=Topology.uniform(3, 2))
    assert not (tmp_path / "p.npz").exists()


def test_load_rejects_an_archive_that_is_not_a_placement(tmp_path):
    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(ValueError, match=r"not a saved moebalance Placement"):
        Placement.load(tmp_path / "other.npz")


# -- equality --------------------------------------------------------------------------------------

def test_equality_compares_every_array_and_num_experts():
    p = example()
    assert p == example()
    assert p != example(share=[[0.5, 0.75, 1.0, 0.5, 0.25]])
    assert p != example(phy2log=[[0, 2, 1, 0, 1]], share=[[0.5, 1.0, 0.25, 0.5, 0.75]])
    assert p != example(slot_device=[0, 0, 1, 1, 1])
    assert p != example(phy2log=[[0, 1, 2, 0, 3]], share=[[0.5, 1.0, 1.0, 0.5, 1.0]], num_experts=4)
    assert p != PHY2LOG


def test_placements_are_unhashable():
    with pytest.raises(TypeError):
        hash(example())


def test_repr_names_the_sizes_replicas_and_shares():
    text = repr(example())
    assert "num_layers=1" in text and "num_slots=5" in text and "num_experts=3" in text
    assert "replicas per expert 1..2" in text and "shares weighted" in text
    assert "shares equal" in repr(example(share=[[0.5, 0.5, 1.0, 0.5, 0.5]]))
