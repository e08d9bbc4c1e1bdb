"""Routing from global counts: every replica receives its share of the group's pairs (within one
pair), whatever each rank sends; own device first, then the node; deterministic integer flows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import placement_cases

from moebalance import Device, Placement, Topology
from moebalance.dispatch.routing import replica_flows, replica_table, replica_targets


def _counts(seed: int, num_ranks: int, num_experts: int, kind: str) -> torch.Tensor:
    """[G, E] pairs per (rank, expert): "uneven" batch sizes (one rank empty), "preferences"
    (each rank favours other experts) or "uniform"."""
    gen = np.random.default_rng(seed)
    if kind == "uniform":
        counts = np.full((num_ranks, num_experts), 50)
    else:
        sizes = gen.integers(0, 3000, num_ranks)
        sizes[gen.integers(num_ranks)] = 0
        if kind == "preferences":
            sizes[:] = 2000
        probs = gen.dirichlet(np.full(num_experts, 0.3), size=num_ranks)
        counts = np.stack([gen.multinomial(n, p) for n, p in zip(sizes, probs)])
    return torch.from_numpy(counts.astype(np.int64))


def _node_masks(nodes) -> torch.Tensor:
    nodes = np.asarray(nodes)
    return torch.from_numpy(nodes[None] == np.unique(nodes)[:, None])


def _example() -> Placement:
    """4 ranks x 2 slots; expert 0 has four replicas with shares .1/.2/.3/.4, expert 1 three
    (one of share 0), expert 2 one."""
    phy2log = np.array([[0, 1, 0, 1, 0, 2, 0, 1]])
    share = np.array([[0.1, 0.7, 0.2, 0.0, 0.3, 1.0, 0.4, 0.3]])
    return Placement(phy2log, share, np.repeat(np.arange(4), 2), 3).validate()


def test_replica_table_lists_replicas_in_slot_order():
    table = replica_table(_example(), 0)
    assert table.slots_EX.tolist() == [[0, 2, 4, 6], [1, 3, 7, -1], [5, -1, -1, -1]]
    assert table.device_EX.tolist() == [[0, 1, 2, 3], [0, 1, 3, -1], [2, -1, -1, -1]]
    np.testing.assert_allclose(table.share_EX.numpy()[1], [0.7, 0.0, 0.3, 0.0])


@given(st.integers(0, 10**6), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6))
def test_targets_sum_to_the_total_and_stay_within_one_of_the_share(total, weights):
    w = np.asarray(weights)
    share = w / w.sum() if w.sum() > 0 else np.full(w.size, 1.0 / w.size)
    target = replica_targets(torch.tensor([total]), torch.from_numpy(share[None]))[0].numpy()
    assert target.sum() == total and np.all(target >= 0)
    assert np.all(np.abs(target - share * total) <= 1.0)
    assert np.all(target[share == 0] == 0)


def test_shares_summing_a_hair_under_one_never_send_pairs_to_padding():
    share = torch.tensor([[0.3, 0.7 - 1e-9, 0.0, 0.0], [1.0 - 1e-9, 0.0, 0.0, 0.0]],
                         dtype=torch.float64)
    total = torch.tensor([10**9, 10**9 + 1])
    target = replica_targets(total, share)
    assert target.tolist() == [[300000000, 700000000, 0, 0], [10**9 + 1, 0, 0, 0]]


@settings(max_examples=60)
@given(placement_cases(max_devices=6, max_slots=4, max_layers=2),
       st.sampled_from(["uneven", "preferences", "uniform"]), st.integers(0, 1000),
       st.booleans())
def test_every_replica_receives_its_share_of_the_global_pairs(case, kind, seed, with_nodes):
    p = case.placement
    G = p.num_devices
    nodes = _node_masks(np.arange(G) // 2) if with_nodes else None
    counts = _counts(seed, G, p.num_experts, kind)
    for layer in range(p.num_layers):
        table = replica_table(p, layer)
        flow = replica_flows(counts, table.share_EX, table.device_EX, nodes)
        assert flow.dtype == torch.int64 and bool((flow >= 0).all())
        assert torch.equal(flow.sum(dim=2), counts)
        received = flow.sum(dim=0).numpy()
        expected = table.share_EX.numpy() * counts.sum(dim=0).numpy()[:, None]
        assert np.all(np.abs(received - expected) <= 1.0), (received, expected)
        assert np.all(received[~table.valid_EX.numpy()] == 0)


@settings(max_examples=40)
@given(placement_cases(max_devices=6, max_slots=4, max_layers=1), st.integers(0, 1000))
def test_the_holder_of_a_replica_keeps_as_many_of_its_pairs_as_the_target_allows(case, seed):
    p = case.placement
    counts = _counts(seed, p.num_devices, p.num_experts, "uneven")
    table = replica_table(p, 0)
    flow = replica_flows(counts, table.share_EX, table.device_EX).numpy()
    target = replica_targets(counts.sum(dim=0), table.share_EX).numpy()
    for e, j in zip(*np.nonzero(table.valid_EX.numpy())):
        g = int(table.device_EX[e, j])
        assert flow[g, e, j] == min(int(counts[g, e]), target[e, j])


@settings(max_examples=40)
@given(placement_cases(max_devices=6, max_slots=4, max_layers=1), st.integers(0, 1000))
def test_node_preference_keeps_as_much_traffic_on_the_node_as_the_targets_allow(case, seed):
    p = case.placement
    G = p.num_devices
    node_of = np.arange(G) // 2
    counts = _counts(seed, G, p.num_experts, "preferences")
    table = replica_table(p, 0)
    device = table.device_EX.numpy()
    valid = device >= 0
    replica_node = np.where(valid, node_of[np.maximum(device, 0)], -1)

    def on_node(flow):
        return sum(flow[g][replica_node == node_of[g]].sum() for g in range(G))

    with_nodes = replica_flows(counts, table.share_EX, table.device_EX, _node_masks(node_of))
    without = replica_flows(counts, table.share_EX, table.device_EX)
    assert on_node(with_nodes.numpy()) >= on_node(without.numpy())
    # After the local tier, each node keeps min(its ranks' remaining pairs, its replicas'
    # remaining room) of every expert: nothing crosses nodes that could have stayed.
    target = replica_targets(counts.sum(dim=0), table.share_EX).numpy()
    flow = with_nodes.numpy()
    for e in range(p.num_experts):
        for n in np.unique(node_of):
            ranks = np.flatnonzero(node_of == n)
            cols = np.flatnonzero(replica_node[e] == n)
            local = [flow[device[e, j], e, j] for j in cols]
            supply = counts[ranks, e].sum().item() - sum(local)
            room = target[e, cols].sum() - sum(local)
            stayed = flow[np.ix_(ranks, [e], cols)].sum() - sum(local)
            assert stayed == min(supply, room)


def test_uneven_batches_meet_the_shares_that_an_equal_split_assumption_missed():
    # Tokens per rank [12000, 6000, 0, 14000], the same preferences everywhere: replicas of
    # expert 0 with shares .1/.2/.3/.4 must receive exactly those fractions of its pairs.
    p = _example()
    table = replica_table(p, 0)
    counts = torch.tensor([[12000, 3000, 10], [6000, 1500, 5], [0, 0, 0], [14000, 3500, 12]])
    flow = replica_flows(counts, table.share_EX, table.device_EX)
    np.testing.assert_array_equal(flow.sum(dim=0)[0].numpy(), [3200, 6400, 9600, 12800])
    np.testing.assert_array_equal(flow.sum(dim=0)[1].numpy(), [5600, 0, 2400, 0])
    assert int(flow[2].sum()) == 0   # rank 2 has nothing to send


def test_flows_are_identical_on_every_call():
    p = _example()
    table = replica_table(p, 0)
    counts = _counts(3, 4, 3, "uneven")
    first = replica_flows(counts, table.share_EX, table.device_EX, _node_masks([0, 0, 1, 1]))
    again = replica_flows(counts.clone(), table.share_EX.clone(), table.device_EX.clone(),
                          _node_masks([0, 0, 1, 1]))
    assert torch.equal(first, again)


def test_replica_table_device_argument_moves_tensors():
    table = replica_table(_example(), 0, device="cpu")
    assert {t.device.type for t in (table.slots_EX, table.device_EX, table.share_EX)} == {"cpu"}


@pytest.mark.parametrize("layer, error", [(1, ValueError), (-1, ValueError), (0.5, TypeError)])
def test_bad_layer_raises_naming_it(layer, error):
    with pytest.raises(error, match="layer"):
        replica_table(_example(), layer)


def test_placement_of_wrong_type_raises_type_error():
    with pytest.raises(TypeError, match="placement"):
        replica_table(Topology([Device()]), 0)
