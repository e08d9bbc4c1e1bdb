"""Routing tables: valid thresholds, shares met over all ranks, locality, reachability, frequencies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from strategies import placement_cases

from moebalance import Device, Placement, Topology
from moebalance.dispatch import reference
from moebalance.dispatch.routing import RoutingTable, route_probabilities, routing_table

ONE = reference.HASH_ONE


def _widths(table: RoutingTable) -> np.ndarray:
    """[E, X] probability mass of each replica in units of 2**-24."""
    thr = table.thresholds_EX.numpy()
    return np.diff(np.concatenate([np.zeros((thr.shape[0], 1), np.int64), thr], axis=1), axis=1)


def _tables(placement: Placement, layer: int) -> list[RoutingTable]:
    R = placement.num_devices
    return [routing_table(placement, layer, r, R) for r in range(R)]


def _example() -> Placement:
    """3 ranks x 2 slots; expert 0 has three replicas (one with share 0), expert 1 two."""
    phy2log = np.array([[0, 1, 0, 2, 1, 0]])
    share = np.array([[0.7, 0.25, 0.3, 1.0, 0.75, 0.0]])
    return Placement(phy2log, share, np.array([0, 0, 1, 1, 2, 2]), 3).validate()


@given(placement_cases(max_devices=5, max_slots=4, max_layers=2))
def test_thresholds_are_valid_cumulative_tables(case):
    p = case.placement
    log2phy = p.log2phy()
    for layer in range(p.num_layers):
        for table in _tables(p, layer):
            slots, thr = table.slots_EX.numpy(), table.thresholds_EX.numpy()
            assert slots.dtype == np.int64 and thr.dtype == np.int64
            assert slots.shape == thr.shape == (p.num_experts, log2phy.shape[2])
            np.testing.assert_array_equal(slots, log2phy[layer])
            assert np.all(np.diff(thr, axis=1) >= 0)
            assert np.all(thr[slots < 0] == ONE)
            last_valid = (slots >= 0).sum(axis=1) - 1
            assert np.all(thr[np.arange(p.num_experts), last_valid] == ONE)


@given(placement_cases(max_devices=6, max_slots=4, max_layers=2))
def test_replicas_receive_their_share_over_all_ranks(case):
    p = case.placement
    for layer in range(p.num_layers):
        tables = _tables(p, layer)
        received = sum(_widths(t) for t in tables) / (ONE * len(tables))
        slots = tables[0].slots_EX.numpy()
        valid = slots >= 0
        np.testing.assert_allclose(received[valid], p.share[layer][slots[valid]], atol=1e-6, rtol=0)


@given(placement_cases(max_devices=6, max_slots=4, max_layers=2))
def test_local_replica_keeps_min_one_or_R_times_share(case):
    p = case.placement
    R = p.num_devices
    for layer in range(p.num_layers):
        for rank, table in enumerate(_tables(p, layer)):
            slots = table.slots_EX.numpy()
            local = (slots >= 0) & (p.slot_device[np.maximum(slots, 0)] == rank)
            expected = np.minimum(1.0, R * p.share[layer][slots[local]])
            np.testing.assert_allclose(_widths(table)[local] / ONE, expected, atol=1e-6, rtol=0)


@given(placement_cases(max_devices=6, max_slots=4, max_layers=2))
def test_zero_share_replicas_get_no_probability(case):
    p = case.placement
    for layer in range(p.num_layers):
        for table in _tables(p, layer):
            slots = table.slots_EX.numpy()
            zero = (slots >= 0) & (p.share[layer][np.maximum(slots, 0)] == 0)
            assert np.all(_widths(table)[zero] == 0)


def test_zero_share_replica_is_never_routed_to():
    p = _example()
    ids = torch.zeros(20000, 2, dtype=torch.int64)
    for rank, table in enumerate(_tables(p, 0)):
        slot = reference.route(ids, table.slots_EX, table.thresholds_EX, pair_offset=rank * 7919)
        assert not torch.any(slot == 5)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_route_frequencies_match_probabilities(rank):
    p = _example()
    table = routing_table(p, 0, rank, 3)
    _, prob = route_probabilities(p, 0, rank, 3)
    n = 1 << 16
    for expert in range(p.num_experts):
        ids = torch.full((n // 4, 4), expert, dtype=torch.int64)
        slot = reference.route(ids, table.slots_EX, table.thresholds_EX, pair_offset=12345)
        hits = torch.bincount(slot.reshape(-1), minlength=p.num_slots).numpy() / n
        slots = table.slots_EX.numpy()[expert]
        for j, s in enumerate(slots[slots >= 0]):
            assert abs(hits[s] - prob[expert, j]) < 2e-3, (expert, s, hits[s], prob[expert, j])


def test_replicas_with_probability_at_least_2_pow_minus_24_are_reachable():
    tiny = 2.0 ** -23
    phy2log = np.array([[0, 1, 1, 0, 0, 1]])
    share = np.array([[1.0 - 2 * tiny, 0.5, 0.5 - 1e-9, tiny, tiny, 1e-9]])
    p = Placement(phy2log, share, np.array([0, 0, 1, 1, 2, 2]), 2).validate()
    for rank in range(3):
        _, prob = route_probabilities(p, 0, rank, 3)
        widths = _widths(routing_table(p, 0, rank, 3))
        assert np.all(widths[prob >= 2.0 ** -24] >= 1)
        assert np.all(widths[prob == 0] == 0)


def test_equal_split_over_every_rank_keeps_all_tokens_local():
    # Every rank holds one replica of every expert with share 1/R: nothing needs to leave a rank.
    R, E = 3, 4
    phy2log = np.tile(np.arange(E), R)[None]
    share = np.full((1, R * E), 1.0 / R)
    p = Placement(phy2log, share, np.repeat(np.arange(R), E), E).validate()
    for rank, table in enumerate(_tables(p, 0)):
        slots = table.slots_EX.numpy()
        local = p.slot_device[slots] == rank
        assert np.all(_widths(table)[local] == ONE)


def test_routing_table_is_deterministic():
    p = _example()
    a, b = routing_table(p, 0, 1, 3), routing_table(p, 0, 1, 3)
    assert torch.equal(a.slots_EX, b.slots_EX) and torch.equal(a.thresholds_EX, b.thresholds_EX)


def test_routing_table_device_argument_moves_tensors():
    table = routing_table(_example(), 0, 0, 3, device="cpu")
    assert table.slots_EX.device.type == "cpu" and table.thresholds_EX.device.type == "cpu"


@pytest.mark.parametrize("kwargs, match", [
    (dict(layer=1, rank=0, num_ranks=3), "layer"),
    (dict(layer=0, rank=3, num_ranks=3), "rank"),
    (dict(layer=0, rank=0, num_ranks=4), "num_ranks"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        routing_table(_example(), **kwargs)


def test_placement_of_wrong_type_raises_type_error():
    with pytest.raises(TypeError, match="placement"):
        routing_table(Topology([Device()]), 0, 0, 1)


# -- node preference -------------------------------------------------------------------------------


def _node_traffic(p: Placement, layer: int, nodes) -> tuple[np.ndarray, float]:
    """Expected fraction received by every replica [E, X] (over all ranks), and the fraction of
    all pairs that stay on their rank's node, with routing given ``nodes`` (None: no preference)."""
    R = p.num_devices
    node_of = np.asarray([0] * R if nodes is None else nodes)
    received, on_node = 0.0, 0.0
    for r in range(R):
        slots, prob = route_probabilities(p, layer, r, R, nodes)
        received = received + prob / R
        device = p.slot_device[np.where(slots >= 0, slots, 0)]
        on_node += np.where((slots >= 0) & (node_of[device] == node_of[r]), prob, 0.0).sum() / R
    return received, on_node


@given(placement_cases(max_devices=6, max_slots=4, max_layers=1))
def test_node_preference_keeps_shares_and_rows(case):
    p = case.placement
    nodes = np.arange(p.num_devices) // 2
    for r in range(p.num_devices):
        _, prob = route_probabilities(p, 0, r, p.num_devices, nodes)
        assert np.all(prob >= 0)
        np.testing.assert_allclose(prob.sum(axis=1), 1.0, atol=1e-12)
    received, _ = _node_traffic(p, 0, nodes)
    slots = p.log2phy()[0]
    valid = slots >= 0
    np.testing.assert_allclose(received[valid], p.share[0][slots[valid]], atol=1e-9, rtol=0)


@given(placement_cases(max_devices=6, max_slots=4, max_layers=1))
def test_node_preference_keeps_more_traffic_on_the_node(case):
    p = case.placement
    nodes = np.arange(p.num_devices) // 2
    _, with_nodes = _node_traffic(p, 0, nodes)
    # the same routing without a node tier, judged by the same node map
    R = p.num_devices
    without = 0.0
    for r in range(R):
        slots, prob = route_probabilities(p, 0, r, R)
        device = p.slot_device[np.where(slots >= 0, slots, 0)]
        without += np.where((slots >= 0) & (nodes[device] == nodes[r]), prob, 0.0).sum() / R
    assert with_nodes >= without - 1e-9


def test_node_preference_sends_across_nodes_only_what_the_node_cannot_take():
    # Expert 0: replicas on ranks 0 (node 0) and 2 (node 1), share 1/2 each; 4 ranks, 2 nodes.
    phy2log = np.array([[0, 1, 1, 2, 0, 3, 3, 2]])
    share = np.array([[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    p = Placement(phy2log, share, np.array([0, 0, 1, 1, 2, 2, 3, 3]), 4).validate()
    nodes = [0, 0, 1, 1]
    # rank 1 holds no replica of expert 0; the one on its node (rank 0) has room: all its
    # expert-0 pairs stay on node 0.
    slots, prob = route_probabilities(p, 0, 1, 4, nodes)
    row = dict(zip(slots[0].tolist(), prob[0].tolist()))
    assert row[0] == pytest.approx(1.0) and row[4] == pytest.approx(0.0)
    # without node preference half of them would cross to rank 2 on node 1
    slots, prob = route_probabilities(p, 0, 1, 4)
    row = dict(zip(slots[0].tolist(), prob[0].tolist()))
    assert row[0] == pytest.approx(0.5) and row[4] == pytest.approx(0.5)


def test_bad_nodes_argument_is_a_clear_error():
    with pytest.raises(ValueError, match="nodes must list the integer node of each of the 3 ranks"):
        routing_table(_example(), 0, 0, 3, nodes=[0, 1])
