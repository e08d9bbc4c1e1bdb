"""Device and Topology: construction, derived arrays, round trips, equality and bad input."""

from __future__ import annotations

import copy
import json
import pickle

import numpy as np
import pytest
from hypothesis import given
from strategies import topologies

from moebalance import Device, Topology

# -- Device -------------------------------------------------------------------------------------

def test_device_defaults_are_one_unit_slot_on_node_zero():
    assert Device() == Device(speed=1.0, slots=1, node=0)


def test_device_normalises_numpy_scalars_to_python_numbers():
    d = Device(speed=np.float32(0.5), slots=np.int64(3), node=np.int32(2))
    assert (d.speed, d.slots, d.node) == (0.5, 3, 2)
    assert type(d.speed) is float and type(d.slots) is int and type(d.node) is int


def test_device_accepts_integral_float_slots():
    assert Device(slots=4.0).slots == 4


@pytest.mark.parametrize("speed", [0, 0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_device_rejects_non_positive_or_non_finite_speed(speed):
    with pytest.raises(ValueError, match=r"speed"):
        Device(speed=speed)


@pytest.mark.parametrize("slots", [0, -2, 2.5, True, False, "3"])
def test_device_rejects_non_integer_or_non_positive_slots(slots):
    with pytest.raises(ValueError, match=r"slots"):
        Device(slots=slots)


def test_device_rejects_nan_slots_naming_the_argument():
    with pytest.raises(ValueError, match=r"slots"):
        Device(slots=float("nan"))


@pytest.mark.parametrize("node", [-1, 0.5, True])
def test_device_rejects_bad_node(node):
    with pytest.raises(ValueError, match=r"node"):
        Device(node=node)


def test_device_is_frozen():
    d = Device()
    with pytest.raises(AttributeError):
        d.speed = 2.0  # type: ignore[misc]


# -- Topology construction ------------------------------------------------------------------------

def test_topology_arrays_follow_devices_in_rank_order():
    topo = Topology([Device(speed=1.0, slots=2, node=0), Device(speed=0.5, slots=3, node=0),
                     Device(speed=2.0, slots=1, node=1)])
    np.testing.assert_array_equal(topo.speed, [1.0, 0.5, 2.0])
    np.testing.assert_array_equal(topo.slots, [2, 3, 1])
    np.testing.assert_array_equal(topo.node, [0, 0, 1])
    np.testing.assert_array_equal(topo.slot_offsets, [0, 2, 5, 6])
    np.testing.assert_array_equal(topo.slot_device, [0, 0, 1, 1, 1, 2])
    assert topo.speed.dtype == np.float64
    for arr in (topo.slots, topo.node, topo.slot_offsets, topo.slot_device):
        assert arr.dtype == np.int64
    assert (topo.num_devices, topo.num_slots, topo.num_nodes) == (3, 6, 2)
    assert [list(topo.device_slots(g)) for g in range(3)] == [[0, 1], [2, 3, 4], [5]]
    assert not topo.is_homogeneous


def test_topology_accepts_any_iterable_of_devices():
    assert Topology(Device(slots=k) for k in (1, 2)) == Topology([Device(slots=1), Device(slots=2)])


def test_topology_arrays_are_read_only():
    topo = Topology.uniform(2, 2)
    for arr in (topo.speed, topo.slots, topo.node, topo.slot_offsets, topo.slot_device):
        with pytest.raises(ValueError):
            arr[0] = 7


def test_topology_rejects_no_devices():
    with pytest.raises(ValueError, match=r"at least one Device"):
        Topology([])


def test_topology_rejects_non_device_entries_naming_the_index():
    with pytest.raises(TypeError, match=r"\[1\].*Device"):
        Topology([Device(), {"speed": 1.0, "slots": 2}])


@given(topologies(max_devices=8, max_slots=5))
def test_slot_ranges_partition_the_slots_device_by_device(topo):
    seen = []
    for g in range(topo.num_devices):
        owned = list(topo.device_slots(g))
        assert len(owned) == topo.slots[g]
        assert all(topo.slot_device[s] == g for s in owned)
        seen += owned
    assert seen == list(range(topo.num_slots))
    assert topo.num_slots == int(topo.slots.sum())
    assert np.all(np.diff(topo.slot_device) >= 0)


# -- uniform ---------------------------------------------------------------------------------------

def test_uniform_groups_devices_into_nodes():
    topo = Topology.uniform(num_devices=5, slots_per_device=3, devices_per_node=2, speed=2.0)
    np.testing.assert_array_equal(topo.node, [0, 0, 1, 1, 2])
    np.testing.assert_array_equal(topo.slots, [3] * 5)
    np.testing.assert_array_equal(topo.speed, [2.0] * 5)
    assert topo.is_homogeneous and topo.num_nodes == 3 and topo.num_slots == 15


def test_uniform_defaults_to_one_node():
    topo = Topology.uniform(4, 2)
    assert topo.num_nodes == 1 and np.all(topo.node == 0)


@pytest.mark.parametrize("kwargs, name, error", [
    (dict(num_devices=0, slots_per_device=2), "num_devices", ValueError),
    (dict(num_devices=2.5, slots_per_device=2), "num_devices", TypeError),   # not an integer
    (dict(num_devices=True, slots_per_device=2), "num_devices", TypeError),
    (dict(num_devices=2, slots_per_device=2, devices_per_node=0), "devices_per_node", ValueError),
    (dict(num_devices=2, slots_per_device=0), "slots", ValueError),
    (dict(num_devices=2, slots_per_device=1.5), "slots", ValueError),
    (dict(num_devices=2, slots_per_device=2, speed=0.0), "speed", ValueError),
    (dict(num_devices=2, slots_per_device=2, speed=float("nan")), "speed", ValueError),
])
def test_uniform_rejects_bad_arguments(kwargs, name, error):
    with pytest.raises(error, match=name):
        Topology.uniform(**kwargs)


# -- from_arrays / dict round trip -----------------------------------------------------------------

def test_from_arrays_builds_the_same_topology_as_devices():
    topo = Topology.from_arrays(np.array([1.0, 0.5]), [4, 6], node=(0, 1))
    assert topo == Topology([Device(1.0, 4, 0), Device(0.5, 6, 1)])


def test_from_arrays_defaults_every_device_to_node_zero():
    assert np.all(Topology.from_arrays([1.0, 2.0, 3.0], [1, 1, 1]).node == 0)


def test_from_arrays_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    topo = Topology.from_arrays(torch.tensor([1.0, 0.5]), torch.tensor([2, 3]))
    assert topo == Topology([Device(1.0, 2), Device(0.5, 3)])


def test_from_arrays_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match=r"one entry per device"):
        Topology.from_arrays([1.0, 1.0], [2, 2, 2])
    with pytest.raises(ValueError, match=r"one entry per device"):
        Topology.from_arrays([1.0, 1.0], [2, 2], node=[0])


@pytest.mark.parametrize("speed, slots, name", [
    ([1.0, 0.0], [2, 2], "speed"),
    ([1.0, -1.0], [2, 2], "speed"),
    ([1.0, float("nan")], [2, 2], "speed"),
    ([1.0, float("inf")], [2, 2], "speed"),
    ([1.0, 1.0], [2, 0], "slots"),
    ([1.0, 1.0], [2, -3], "slots"),
])
def test_from_arrays_rejects_bad_speeds_and_slots(speed, slots, name):
    with pytest.raises(ValueError, match=name):
        Topology.from_arrays(speed, slots)


def test_from_arrays_rejects_empty_arrays():
    with pytest.raises(ValueError, match=r"at least one Device"):
        Topology.from_arrays([], [])


def test_from_arrays_rejects_non_integer_slots():
    with pytest.raises(ValueError, match=r"slots"):
        Topology.from_arrays([1.0, 1.0], [2, 2.5])


def test_from_arrays_rejects_non_integer_nodes():
    with pytest.raises(ValueError, match=r"node"):
        Topology.from_arrays([1.0, 1.0], [2, 2], node=[0, 0.5])


@given(topologies(max_devices=8, max_slots=5))
def test_dict_round_trip_is_exact_and_json_serialisable(topo):
    data = topo.to_dict()
    assert Topology.from_dict(json.loads(json.dumps(data))) == topo
    assert Topology.from_dict(data) == topo


def test_from_dict_without_node_puts_devices_on_node_zero():
    topo = Topology.from_dict({"speed": [1.0, 2.0], "slots": [1, 3]})
    assert topo == Topology([Device(1.0, 1, 0), Device(2.0, 3, 0)])


@given(topologies(max_devices=6, max_slots=4))
def test_pickle_and_deepcopy_round_trip(topo):
    # Topologies travel to workers (multiprocessing, torch.distributed object collectives).
    for other in (pickle.loads(pickle.dumps(topo)), copy.deepcopy(topo)):
        assert other == topo and hash(other) == hash(topo)
        np.testing.assert_array_equal(other.slot_device, topo.slot_device)
        np.testing.assert_array_equal(other.slot_offsets, topo.slot_offsets)


# -- equality and hashing --------------------------------------------------------------------------

def test_equal_topologies_hash_equal_and_work_as_keys():
    a = Topology([Device(1, 2, 0), Device(0.5, 3, 1)])
    b = Topology.from_arrays([1.0, 0.5], [2, 3], [0, 1])
    assert a == b and hash(a) == hash(b)
    assert {a: "cached plan"}[b] == "cached plan"
    assert len({a, b}) == 1


@pytest.mark.parametrize("other", [
    Topology([Device(0.5, 3, 1), Device(1, 2, 0)]),  # same devices, other rank order
    Topology([Device(1, 2, 0), Device(0.5, 3, 0)]),  # other node
    Topology([Device(1, 2, 0), Device(0.75, 3, 1)]),  # other speed
    Topology([Device(1, 2, 0), Device(0.5, 4, 1)]),  # other slots
    Topology([Device(1, 2, 0)]),  # fewer devices
])
def test_topologies_differing_in_any_device_field_or_order_are_unequal(other):
    assert Topology([Device(1, 2, 0), Device(0.5, 3, 1)]) != other


def test_topology_is_not_equal_to_other_types():
    topo = Topology.uniform(2, 2)
    assert topo != topo.to_dict()
    assert topo != "Topology"


def test_is_homogeneous_needs_equal_speeds_and_slots():
    assert Topology.uniform(3, 2, speed=0.5).is_homogeneous
    assert not Topology.from_arrays([1.0, 2.0], [2, 2]).is_homogeneous
    assert not Topology.from_arrays([1.0, 1.0], [2, 3]).is_homogeneous
    # Node layout does not make devices unlike.
    assert Topology.from_arrays([1.0, 1.0], [2, 2], [0, 1]).is_homogeneous


def test_repr_names_the_sizes():
    text = repr(Topology.from_arrays([1.0, 0.5], [2, 3], [0, 1]))
    assert "num_devices=2" in text and "num_slots=5" in text and "num_nodes=2" in text


def test_repr_lists_one_value_per_device_in_runs():
    text = repr(Topology.from_arrays([1.0, 1.0, 0.5, 0.5, 0.5], [3, 3, 4, 4, 2], [0, 0, 1, 1, 1]))
    assert "speed=[1.0 x 2, 0.5 x 3]" in text and "slots=[3 x 2, 4 x 2, 2]" in text
    assert "node=[0 x 2, 1 x 3]" in text
    many = repr(Topology.from_arrays([1.0, 0.5] * 10, [2] * 20))
    assert "speed=[1.0, 0.5," in many and "... 12 more runs]" in many
