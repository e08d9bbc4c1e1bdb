"""EPLB baseline, the EPLB-style plan for any topology, and the rebalance_experts drop-in.

Shapes: L layers, E experts, R replicas (slots), G GPUs, X max replicas.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import loads as loads_strategy
from strategies import topologies

from moebalance import Device, Topology, balancedness, imbalance
from moebalance.lab.eplb_reference import eplb_baseline, eplb_style_plan, placement_from_phy2log
from moebalance.planner.eplb import rebalance_experts


def gpu_balancedness(w_LE, phy2log_LR, num_gpus):
    """[L] mean/max GPU load, loads = w / replicas summed per GPU (EPLB's figure)."""
    L, R = phy2log_LR.shape
    cnt = np.stack([np.bincount(row, minlength=w_LE.shape[1]) for row in phy2log_LR])
    slot = np.take_along_axis(w_LE, phy2log_LR, 1) / np.take_along_axis(cnt, phy2log_LR, 1)
    load = slot.reshape(L, num_gpus, R // num_gpus).sum(-1)
    peak = load.max(1)
    return np.where(peak > 0, load.mean(1) / np.where(peak > 0, peak, 1), 1.0)


def has_duplicates(phy2log_LR, num_gpus):
    """[L] bool: some GPU holds one expert twice."""
    L, R = phy2log_LR.shape
    per_gpu = np.sort(phy2log_LR.reshape(L, num_gpus, R // num_gpus), axis=-1)
    return (np.diff(per_gpu, axis=-1) == 0).any(axis=(1, 2))


@st.composite
def eplb_configs(draw, max_layers=3):
    """(weight [L, E], num_replicas, num_groups, num_nodes, num_gpus) that the drop-in accepts."""
    num_gpus = draw(st.sampled_from([1, 2, 4, 8]))
    num_nodes = draw(st.sampled_from([d for d in (1, 2, 4) if num_gpus % d == 0]))
    num_groups = draw(st.sampled_from([1, 2, 4, 8]))
    group_size = draw(st.integers(1, 4))
    E = num_groups * group_size
    hierarchical = num_groups % num_nodes == 0
    pool = E // num_nodes if hierarchical else E
    per_gpu = draw(st.integers(-(-E // num_gpus), max(pool, -(-E // num_gpus))))
    if per_gpu > pool:  # no duplicate-free plan exists: duplicates are tested apart
        num_nodes = 1
    L = draw(st.integers(1, max_layers))
    weight = draw(loads_strategy(L, E, max_load=1000))
    return weight, num_gpus * per_gpu, num_groups, num_nodes, num_gpus


# -- the baseline --------------------------------------------------------------------------------
def test_baseline_matches_eplb_readme_example():
    # The example of EPLB's README: 2 layers, 12 experts in 4 groups, 2 nodes, 8 GPUs, 16 slots.
    weight = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                       [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    phy2log, log2phy, logcnt = eplb_baseline(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert logcnt.tolist() == [np.bincount(row, minlength=12).tolist() for row in phy2log]
    assert log2phy.shape == (2, 12, int(logcnt.max()))


def test_baseline_global_policy_by_hand():
    # Expert 0 takes both spare slots (load per replica 100/1, then 100/2 > 1); replicas 33.3 x 3
    # and 1 pack two per GPU: GPU0, GPU1, then the tie goes to GPU0, which ends with expert 0
    # twice: EPLB's duplicate.
    phy2log, log2phy, logcnt = eplb_baseline(np.array([[100.0, 1.0]]), 4, 1, 1, 2)
    assert phy2log.tolist() == [[0, 0, 0, 1]]
    assert logcnt.tolist() == [[3, 1]]
    # Replica ranks in creation order: rank 1 landed in slot 2, rank 2 in slot 1.
    assert log2phy.tolist() == [[[0, 2, 1], [3, -1, -1]]]


def test_baseline_hierarchical_policy_by_hand():
    # Group totals [3, 7, 11, 15] pack to 2 nodes: node 0 gets groups 3 and 0, node 1 groups 2
    # and 1; with one GPU per node and no spare slot, each GPU lists its experts heaviest first.
    phy2log, _, logcnt = eplb_baseline(np.arange(1.0, 9.0)[None, :], 8, 4, 2, 2)
    assert phy2log.tolist() == [[7, 6, 1, 0, 5, 4, 3, 2]]
    assert logcnt.tolist() == [[1] * 8]


# -- the drop-in: conventions --------------------------------------------------------------------
@given(eplb_configs())
def test_rebalance_experts_keeps_eplb_conventions(config):
    weight, R, num_groups, num_nodes, num_gpus = config
    L, E = weight.shape
    phy2log, log2phy, logcnt = rebalance_experts(weight, R, num_groups, num_nodes, num_gpus)
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == np.int64
    assert phy2log.shape == (L, R) and logcnt.shape == (L, E)
    assert log2phy.shape == (L, E, R - E + 1)
    assert phy2log.min() >= 0 and phy2log.max() < E
    for layer in range(L):
        np.testing.assert_array_equal(logcnt[layer], np.bincount(phy2log[layer], minlength=E))
        for e in range(E):
            slots = log2phy[layer, e]
            held = slots[slots >= 0]
            assert np.all(slots[len(held):] == -1)  # padding only at the end
            np.testing.assert_array_equal(held, np.flatnonzero(phy2log[layer] == e))
    assert np.all(logcnt >= 1)
    assert not has_duplicates(phy2log, num_gpus).any()
    if num_groups % num_nodes == 0:
        # GPU g owns slots g*R/G..; node n owns GPUs n*G/N..: every group lives on one node.
        node_of_slot = np.arange(R) // (R // num_nodes)
        group_of_slot = phy2log // (E // num_groups)
        for layer in range(L):
            nodes_per_group = [np.unique(node_of_slot[group_of_slot[layer] == g]).size
                               for g in range(num_groups)]
            assert nodes_per_group == [1] * num_groups


def test_rebalance_experts_keeps_every_group_on_one_node():
    # Three layers, two groups of three experts, two nodes of two GPUs, 12 replicas.
    weight = np.array([[3, 9, 27, 81, 1, 5], [81, 27, 9, 3, 5, 1], [8] * 6], dtype=np.float64)
    phy2log, _, _ = rebalance_experts(weight, 12, 2, 2, 4)
    for layer in range(3):
        for node in range(2):
            groups = np.unique(phy2log[layer, node * 6:(node + 1) * 6] // 3)
            assert groups.size == 1, (layer, phy2log[layer])


@pytest.mark.parametrize("args", [
    (np.ones((1, 5)), 8, 1, 1, 1),                  # 8 slots on one GPU, 5 experts
    (np.arange(1.0, 9.0)[None, :], 32, 1, 1, 2),    # 16 slots per GPU, 8 experts
    (np.arange(1.0, 9.0)[None, :], 24, 4, 4, 4),    # 6 slots per GPU, 2 experts per node
])
def test_rebalance_experts_places_forced_duplicates_with_a_warning(args):
    with pytest.warns(UserWarning, match="holds two replicas of one expert"):
        phy2log, log2phy, logcnt = rebalance_experts(*args)
    weight, R, _, _, G = args
    E = weight.shape[1]
    assert phy2log.shape == (1, R) and log2phy.shape == (1, E, R - E + 1)
    np.testing.assert_array_equal(logcnt[0], np.bincount(phy2log[0], minlength=weight.shape[1]))
    base = eplb_baseline(*args)[0]
    assert gpu_balancedness(weight, phy2log, G)[0] >= gpu_balancedness(weight, base, G)[0] - 1e-12


def test_duplicate_warning_advice_fits_the_arguments():
    with pytest.warns(UserWarning) as record:
        rebalance_experts(np.ones((1, 5)), 8, 1, 1, 1)
    assert "num_nodes=1" not in str(record[0].message)
    with pytest.warns(UserWarning, match="pass num_nodes=1"):
        rebalance_experts(np.ones((1, 8)), 24, 4, 4, 4)


def test_rebalance_experts_torch_in_torch_out(rng):
    weight = torch.from_numpy(rng.integers(0, 500, size=(3, 16))).to(torch.int32)
    phy2log, log2phy, logcnt = rebalance_experts(weight, 24, 4, 2, 4)
    for t in (phy2log, log2phy, logcnt):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.device.type == "cpu"
    expected = rebalance_experts(weight.numpy(), 24, 4, 2, 4)
    for a, b in zip((phy2log, log2phy, logcnt), expected):
        np.testing.assert_array_equal(a.numpy(), b)


def test_rebalance_experts_deterministic_and_layers_independent(rng):
    # Many layers run in chunks on threads; the plan of a layer must not depend on its chunk.
    weight = rng.lognormal(0.0, 1.5, size=(40, 64)) * 100
    whole = rebalance_experts(weight, 96, 8, 4, 16)
    again = rebalance_experts(weight, 96, 8, 4, 16)
    for a, b in zip(whole, again):
        np.testing.assert_array_equal(a, b)
    for layer in (0, 17, 39):
        single = rebalance_experts(weight[layer:layer + 1], 96, 8, 4, 16)
        np.testing.assert_array_equal(single[0][0], whole[0][layer])


@pytest.mark.parametrize("seed", [0, 1])
def test_numpy_path_matches_numba_path(seed):
    rng = np.random.default_rng(seed)
    for num_groups, num_nodes in ((4, 2), (3, 2), (8, 4)):
        weight = rng.pareto(1.0, size=(2, 24)) * 100
        fast = rebalance_experts(weight, 32, num_groups, num_nodes, 8, backend="numba")
        slow = rebalance_experts(weight, 32, num_groups, num_nodes, 8, backend="numpy")
        for a, b in zip(fast, slow):
            np.testing.assert_array_equal(a, b)


def test_backend_choice_follows_moebalance_backends(isolated_backends, rng):
    weight = rng.random((2, 16)) * 100
    expected = rebalance_experts(weight, 24, 4, 2, 4, backend="numba")
    with isolated_backends.using_backend("planner", "numpy"):
        got = rebalance_experts(weight, 24, 4, 2, 4)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


# -- the drop-in: balance ------------------------------------------------------------------------
def _skewed_loads(rng, kind, shape):
    if kind == "lognormal":
        return rng.lognormal(0.0, 1.0, size=shape) * 1000
    if kind == "pareto":
        return rng.pareto(1.5, size=shape) * 100
    if kind == "zipf":  # DeepSeek-like: a few hot experts per layer, integer token counts
        ranks = np.arange(1, shape[1] + 1, dtype=np.float64)
        return np.stack([rng.permutation(np.round(2e5 / ranks ** 1.1)) for _ in range(shape[0])])
    return rng.integers(0, 1000, size=shape).astype(np.float64)


@pytest.mark.parametrize("kind", ["lognormal", "pareto", "zipf", "uniform"])
@pytest.mark.parametrize("policy", [(4, 2), (3, 2)])  # hierarchical, global
def test_rebalance_balances_at_least_as_well_as_eplb(kind, policy):
    rng = np.random.default_rng(7)
    num_groups, num_nodes = policy
    weight = _skewed_loads(rng, kind, (12, 48))
    base = eplb_baseline(weight, 64, num_groups, num_nodes, 8)[0]
    ours = rebalance_experts(weight, 64, num_groups, num_nodes, 8)[0]
    b_base, b_ours = gpu_balancedness(weight, base, 8), gpu_balancedness(weight, ours, 8)
    clean = ~has_duplicates(base, 8)
    # Where EPLB's plan is valid, ours starts from it and only improves: never worse, per layer.
    assert np.all(b_ours[clean] >= b_base[clean] - 1e-12)
    assert b_ours.mean() >= b_base.mean() - 1e-12


def test_rebalance_balances_deepseek_size_better_than_eplb():
    # The one moderate case: DeepSeek-V3's 256 experts, 8 groups on 8 nodes, 64 GPUs, 320 slots.
    rng = np.random.default_rng(3)
    weight = _skewed_loads(rng, "zipf", (8, 256))
    base = eplb_baseline(weight, 320, 8, 8, 64)[0]
    ours = rebalance_experts(weight, 320, 8, 8, 64)[0]
    b_base, b_ours = gpu_balancedness(weight, base, 64), gpu_balancedness(weight, ours, 64)
    clean = ~has_duplicates(base, 64)
    assert np.all(b_ours[clean] >= b_base[clean] - 1e-12)
    assert b_ours.mean() > b_base.mean()
    assert not has_duplicates(ours, 64).any()


# -- EPLB-style plans on any topology ------------------------------------------------------------
@given(st.data())
def test_eplb_style_plan_is_valid_on_any_topology(data):
    topo = data.draw(topologies(max_devices=6, max_slots=4))
    E = data.draw(st.integers(int(topo.slots.max()), topo.num_slots))
    w = data.draw(loads_strategy(data.draw(st.integers(1, 3)), E))
    p = eplb_style_plan(w, topo)
    p.validate(topo)
    # Equal split: every replica of an expert carries 1 / replicas.
    np.testing.assert_allclose(p.share, 1.0 / np.take_along_axis(p.replicas, p.phy2log, 1))


def test_eplb_style_plan_ignores_speeds(rng):
    w = rng.pareto(1.2, size=(3, 20)) * 100
    slots = [3, 5, 2, 6, 4]
    fast = Topology([Device(speed=s, slots=k) for s, k in zip([1, 3, 1, 2, 0.5], slots)])
    plain = Topology([Device(speed=1.0, slots=k) for k in slots])
    assert eplb_style_plan(w, fast) == eplb_style_plan(w, plain)


def test_eplb_style_plan_spreads_a_hot_expert():
    w = np.ones((1, 6))
    w[0, 3] = 100.0
    topo = Topology([Device(slots=k) for k in (2, 3, 2, 3)])
    p = eplb_style_plan(w, topo)
    # Four spare slots: the hot expert would take all four, but holds one per device at most.
    assert p.replicas[0, 3] == topo.num_devices
    assert imbalance(w, p, topo)[0] < 1.2


def test_placement_from_phy2log_keeps_eplb_duplicates():
    phy2log, _, _ = eplb_baseline(np.array([[100.0, 1.0]]), 4, 1, 1, 2)
    topo = Topology.uniform(2, 2)
    p = placement_from_phy2log(phy2log, 2, topo)
    np.testing.assert_array_equal(p.phy2log, phy2log)
    np.testing.assert_allclose(p.share, [[1 / 3, 1 / 3, 1 / 3, 1.0]])
    with pytest.raises(ValueError, match="twice"):
        p.validate(topo)
    w = np.array([[100.0, 1.0]])
    np.testing.assert_allclose(balancedness(w, p, topo), gpu_balancedness(w, phy2log, 2))


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("args, match", [
    ((np.ones(8), 8, 1, 1, 2), "weight must have shape"),
    ((np.full((1, 8), np.nan), 8, 1, 1, 2), "weight must be finite"),
    ((-np.ones((1, 8)), 8, 1, 1, 2), "weight must be >= 0"),
    ((np.ones((1, 8)), 6, 1, 1, 2), "num_replicas .* >= the number of experts"),
    ((np.ones((1, 8)), 9, 1, 1, 2), "multiple of num_gpus"),
    ((np.ones((1, 8)), 8, 1, 3, 2), "num_gpus .* multiple of num_nodes"),
    ((np.ones((1, 8)), 8, 3, 1, 2), "num_groups .* must divide"),
    ((np.ones((1, 8)), 8, 1, 1, 0), "num_gpus must be an integer >= 1"),
])
def test_rebalance_experts_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        rebalance_experts(*args)


def test_rebalance_experts_rejects_counts_that_are_not_integers():
    with pytest.raises(TypeError, match="num_replicas must be an integer"):
        rebalance_experts(np.ones((1, 8)), 8.0, 1, 1, 2)


def test_rebalance_experts_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend must be"):
        rebalance_experts(np.ones((1, 4)), 4, 1, 1, 2, backend="cuda")


def test_eplb_style_plan_rejects_impossible_topologies():
    with pytest.raises(ValueError, match="slots for 8 experts"):
        eplb_style_plan(np.ones((1, 8)), Topology.uniform(2, 3))
    with pytest.raises(ValueError, match="at most 4 slots"):
        eplb_style_plan(np.ones((1, 4)), Topology([Device(slots=5), Device(slots=1)]))
    with pytest.raises(TypeError, match="topology must be"):
        eplb_style_plan(np.ones((1, 4)), "two gpus")


def test_placement_from_phy2log_rejects_bad_ids():
    with pytest.raises(ValueError, match=r"in \[0, 2\)"):
        placement_from_phy2log(np.array([[0, 2]]), 2, Topology.uniform(2, 1))
    with pytest.raises(ValueError, match="shape"):
        placement_from_phy2log(np.array([[0, 1, 1]]), 2, Topology.uniform(2, 1))
