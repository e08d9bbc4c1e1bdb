"""Balance metrics (DESIGN section 2): device loads, imbalance, balancedness and the summary,
checked by hand, against a brute-force loop, and on bad input (invariant 7)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import loads, placement_cases

from moebalance import Device, Placement, Topology, balancedness, imbalance, summary_imbalance
from moebalance._check import as_loads, to_numpy

torch = pytest.importorskip("torch")

# 3 devices (speeds 1, 2, 0.5; slots 2, 2, 1), 3 experts:
#   device 0 holds experts 0 (share .5), 1 (.25); device 1 holds 2 (1), 0 (.5); device 2 holds 1
# (.75).
TOPO = Topology([Device(1.0, 2, 0), Device(2.0, 2, 0), Device(0.5, 1, 1)])
PLACEMENT = Placement([[0, 1, 2, 0, 1]], [[0.5, 0.25, 1.0, 0.5, 0.75]], TOPO.slot_device, 3)
LOADS = np.array([[4.0, 2.0, 6.0]])  # device loads 2.5, 8, 1.5 (sum 12)


def brute_force(loads_LE, placement: Placement, topology: Topology):
    """Device loads [L, G], imbalance [L], balancedness [L] and the summary, by plain loops."""
    L, G = placement.num_layers, topology.num_devices
    device = np.zeros((L, G))
    for layer in range(L):
        for slot in range(placement.num_slots):
            expert = placement.phy2log[layer, slot]
            device[layer, topology.slot_device[slot]] += (loads_LE[layer][expert]
                                                          * placement.share[layer, slot])
    total_speed = sum(d.speed for d in topology.devices)
    imb, bal, worst_sum, ideal_sum = [], [], 0.0, 0.0
    for layer in range(L):
        ideal = sum(loads_LE[layer]) / total_speed
        worst = max(device[layer, g] / topology.devices[g].speed for g in range(G))
        peak = max(device[layer])
        imb.append(worst / ideal if ideal > 0 else 1.0)
        bal.append(sum(device[layer]) / G / peak if peak > 0 else 1.0)
        worst_sum += worst
        ideal_sum += ideal
    summary = worst_sum / ideal_sum if ideal_sum > 0 else 1.0
    return device, np.array(imb), np.array(bal), summary


# -- hand-computed examples ------------------------------------------------------------------------

def test_metrics_of_the_heterogeneous_example_by_hand():
    # times 2.5/1, 8/2, 1.5/0.5 = 2.5, 4, 3; ideal 12 / 3.5; mean load 4, peak 8.
    np.testing.assert_allclose(PLACEMENT.device_loads(LOADS), [[2.5, 8.0, 1.5]])
    np.testing.assert_allclose(imbalance(LOADS, PLACEMENT, TOPO), [4 / (12 / 3.5)])
    np.testing.assert_allclose(balancedness(LOADS, PLACEMENT, TOPO), [0.5])
    assert summary_imbalance(LOADS, PLACEMENT, TOPO) == pytest.approx(4 / (12 / 3.5))


def test_imbalance_and_balancedness_of_a_homogeneous_example_by_hand():
    # Device 0 holds experts 0 and 1, device 1 the other half of expert 0: loads 4*.5+2 and 4*.5.
    topo = Topology.uniform(2, 2)
    p = Placement([[0, 1, 0, 2]], [[0.5, 1.0, 0.5, 1.0]], topo.slot_device, 3)
    w = [[4.0, 2.0, 0.0]]
    np.testing.assert_allclose(p.device_loads(w), [[4.0, 2.0]])
    np.testing.assert_allclose(imbalance(w, p, topo), [4 / 3])
    np.testing.assert_allclose(balancedness(w, p, topo), [3 / 4])


def test_speed_turns_an_uneven_split_into_a_perfect_one():
    # Same placement as above on devices of speed 2 and 1: times 4/2 = 2/1, so imbalance 1.
    topo = Topology.from_arrays([2.0, 1.0], [2, 2])
    p = Placement([[0, 1, 0, 2]], [[0.5, 1.0, 0.5, 1.0]], topo.slot_device, 3)
    w = [[4.0, 2.0, 0.0]]
    np.testing.assert_allclose(imbalance(w, p, topo), [1.0])
    # balancedness is EPLB's homogeneous figure: it ignores speed.
    np.testing.assert_allclose(balancedness(w, p, topo), [3 / 4])


def test_one_expert_split_by_speed_is_perfect():
    topo = Topology.from_arrays([1.0, 2.0], [1, 1])
    p = Placement([[0, 0]], [[1 / 3, 2 / 3]], topo.slot_device, 1).validate(topo)
    np.testing.assert_allclose(imbalance([[9.0]], p, topo), [1.0])


def test_equal_loads_one_expert_per_identical_device_is_perfect():
    topo = Topology.uniform(4, 1)
    p = Placement([[2, 0, 3, 1]], np.ones((1, 4)), topo.slot_device, 4)
    np.testing.assert_allclose(imbalance(np.full((1, 4), 7.0), p, topo), [1.0])
    np.testing.assert_allclose(balancedness(np.full((1, 4), 7.0), p, topo), [1.0])


def test_all_load_on_one_of_g_devices_gives_imbalance_g():
    topo = Topology.uniform(4, 1)
    p = Placement([[0, 1, 2, 3]], np.ones((1, 4)), topo.slot_device, 4)
    w = [[0.0, 0.0, 5.0, 0.0]]
    np.testing.assert_allclose(imbalance(w, p, topo), [4.0])
    np.testing.assert_allclose(balancedness(w, p, topo), [0.25])


def test_a_layer_without_load_counts_as_balanced():
    w = np.array([[0.0, 0.0, 0.0], [4.0, 2.0, 6.0]])
    p = Placement(np.repeat(PLACEMENT.phy2log, 2, axis=0), np.repeat(PLACEMENT.share, 2, axis=0),
                  TOPO.slot_device, 3)
    np.testing.assert_allclose(imbalance(w, p, TOPO), [1.0, 7 / 6])
    np.testing.assert_allclose(balancedness(w, p, TOPO), [1.0, 0.5])
    assert summary_imbalance(np.zeros((2, 3)), p, TOPO) == 1.0


def test_summary_weights_layers_by_their_load():
    # Layer 0 is perfect (worst time 2, ideal 2); layer 1 puts all of its load on one device
    # (worst 2, ideal 1). Summary: (2 + 2) / (2 + 1) = 4/3, not the mean of 1 and 2.
    topo = Topology.uniform(2, 1)
    p = Placement([[0, 1], [0, 1]], np.ones((2, 2)), topo.slot_device, 2)
    w = [[2.0, 2.0], [2.0, 0.0]]
    np.testing.assert_allclose(imbalance(w, p, topo), [1.0, 2.0])
    assert summary_imbalance(w, p, topo) == pytest.approx(4 / 3)


def test_metrics_return_one_float64_per_layer():
    w = np.tile(LOADS, (5, 1))
    p = Placement(np.tile(PLACEMENT.phy2log, (5, 1)), np.tile(PLACEMENT.share, (5, 1)),
                  TOPO.slot_device, 3)
    for metric in (imbalance, balancedness):
        out = metric(w, p, TOPO)
        assert out.shape == (5,) and out.dtype == np.float64
    assert type(summary_imbalance(w, p, TOPO)) is float


# -- properties ------------------------------------------------------------------------------------

@given(placement_cases(max_devices=6, max_slots=4, max_layers=3))
def test_metrics_match_a_brute_force_loop(case):
    device, imb, bal, summary = brute_force(case.loads, case.placement, case.topology)
    np.testing.assert_allclose(case.placement.device_loads(case.loads), device, rtol=1e-12,
                               atol=1e-9)
    np.testing.assert_allclose(imbalance(case.loads, case.placement, case.topology), imb,
                               rtol=1e-9)
    np.testing.assert_allclose(balancedness(case.loads, case.placement, case.topology), bal,
                               rtol=1e-9)
    assert summary_imbalance(case.loads, case.placement, case.topology) == pytest.approx(
        summary, rel=1e-9)


def test_metrics_match_a_brute_force_loop_on_a_larger_seeded_case(rng):
    # 16 devices of 3 speeds, 4..6 slots each, 24 experts, 4 layers, random replicas and shares.
    speeds = rng.choice([0.5, 1.0, 2.0], size=16)
    topo = Topology.from_arrays(speeds, rng.integers(4, 7, size=16), np.arange(16) // 8)
    L, E, S = 4, 24, topo.num_slots
    phy2log = np.empty((L, S), dtype=np.int64)
    for layer in range(L):
        while True:  # redraw until every device holds distinct experts and every expert is held
            row = np.concatenate([rng.permutation(E)[:k] for k in topo.slots])
            if np.unique(row).size == E:
                break
        phy2log[layer] = row
    weight = rng.random((L, S)) + 0.05
    share = np.stack([weight[l] / np.bincount(phy2log[l], weight[l], E)[phy2log[l]]
                      for l in range(L)])
    p = Placement(phy2log, share, topo.slot_device, E).validate(topo)
    w = rng.gamma(0.5, 1000.0, size=(L, E))
    device, imb, bal, summary = brute_force(w, p, topo)
    np.testing.assert_allclose(p.device_loads(w), device, rtol=1e-12)
    np.testing.assert_allclose(imbalance(w, p, topo), imb, rtol=1e-12)
    np.testing.assert_allclose(balancedness(w, p, topo), bal, rtol=1e-12)
    assert summary_imbalance(w, p, topo) == pytest.approx(summary, rel=1e-12)


@given(placement_cases(max_devices=6, max_slots=4, max_layers=3))
def test_device_loads_conserve_the_total_load(case):
    np.testing.assert_allclose(case.placement.device_loads(case.loads).sum(axis=1),
                               case.loads.sum(axis=1), rtol=1e-12, atol=1e-9)


@given(placement_cases(max_devices=6, max_slots=4, max_layers=3))
def test_imbalance_is_at_least_one_and_balancedness_at_most_one(case):
    # The slowest device's time is at least the speed-weighted mean time.
    imb = imbalance(case.loads, case.placement, case.topology)
    bal = balancedness(case.loads, case.placement, case.topology)
    assert np.all(imb >= 1.0 - 1e-12)
    assert np.all((bal > 0) & (bal <= 1.0 + 1e-12))
    assert summary_imbalance(case.loads, case.placement, case.topology) >= 1.0 - 1e-12


@given(placement_cases(max_devices=6, max_slots=4, max_layers=3, heterogeneous=False))
def test_balancedness_is_the_inverse_of_imbalance_on_identical_devices(case):
    imb = imbalance(case.loads, case.placement, case.topology)
    bal = balancedness(case.loads, case.placement, case.topology)
    np.testing.assert_allclose(bal * imb, 1.0, rtol=1e-12)


@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=6), st.integers(1, 5), st.data())
def test_every_expert_on_every_device_split_by_speed_is_perfect(speeds, num_experts, data):
    topo = Topology.from_arrays(speeds, [num_experts] * len(speeds))
    rows = [data.draw(st.permutations(range(num_experts))) for _ in speeds]
    phy2log = np.concatenate(rows)[None, :]
    share = (topo.speed / topo.speed.sum())[topo.slot_device][None, :]
    p = Placement(phy2log, share, topo.slot_device, num_experts).validate(topo)
    w = data.draw(loads(1, num_experts).filter(lambda a: a.sum() > 0))
    np.testing.assert_allclose(imbalance(w, p, topo), [1.0], rtol=1e-9)


@given(placement_cases(max_devices=5, max_layers=2), st.sampled_from([0.125, 3.0, 1000.0]))
def test_imbalance_ignores_the_units_of_load_and_speed(case, scale):
    topo, p, w = case
    scaled = Topology.from_arrays(topo.speed * scale, topo.slots, topo.node)
    base = imbalance(w, p, topo)
    np.testing.assert_allclose(imbalance(w * scale, p, topo), base, rtol=1e-9)
    np.testing.assert_allclose(imbalance(w, p, scaled), base, rtol=1e-9)
    np.testing.assert_allclose(balancedness(w * scale, p, topo), balancedness(w, p, topo),
                               rtol=1e-9)


# -- input types -----------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda a: a.tolist(),
    lambda a: a.astype(np.int32),
    lambda a: a.astype(np.float32),
    lambda a: np.asfortranarray(a),
    lambda a: a[0],  # one layer given as [E]
    lambda a: torch.tensor(a),
    lambda a: torch.tensor(a, dtype=torch.int64),
    lambda a: torch.tensor(a, dtype=torch.float16),
    lambda a: torch.tensor(a, dtype=torch.float32, requires_grad=True),
    lambda a: torch.tensor(a.T.copy()).T,  # non-contiguous view
], ids=["list", "int32", "float32", "fortran", "1d", "torch-f64", "torch-i64", "torch-f16",
        "torch-grad", "torch-strided"])
def test_metrics_accept_numpy_lists_and_torch(make):
    expected_imb = imbalance(LOADS, PLACEMENT, TOPO)
    expected_bal = balancedness(LOADS, PLACEMENT, TOPO)
    np.testing.assert_allclose(imbalance(make(LOADS), PLACEMENT, TOPO), expected_imb)
    np.testing.assert_allclose(balancedness(make(LOADS), PLACEMENT, TOPO), expected_bal)
    np.testing.assert_allclose(PLACEMENT.device_loads(make(LOADS)), [[2.5, 8.0, 1.5]])


def test_metrics_accept_bfloat16_torch_loads():
    w = torch.tensor(LOADS, dtype=torch.bfloat16)
    np.testing.assert_allclose(imbalance(w, PLACEMENT, TOPO), imbalance(LOADS, PLACEMENT, TOPO))


def test_as_loads_returns_a_contiguous_float64_copy_and_leaves_the_input_alone():
    src = np.asfortranarray(np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64))
    out = as_loads(src, "loads", 3)
    assert out.dtype == np.float64 and out.flags.c_contiguous and out.shape == (2, 3)
    out[0, 0] = 99.0
    assert src[0, 0] == 1
    np.testing.assert_array_equal(as_loads([1, 2]), [[1.0, 2.0]])


def test_to_numpy_detaches_torch_tensors():
    t = torch.arange(6, dtype=torch.float32, requires_grad=True).reshape(2, 3)
    np.testing.assert_array_equal(to_numpy(t, "x"), np.arange(6).reshape(2, 3))
    a = np.ones(3)
    assert to_numpy(a, "x") is a


@pytest.mark.gpu
def test_metrics_accept_cupy_and_cuda_tensors():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cupy = pytest.importorskip("cupy")
    expected = imbalance(LOADS, PLACEMENT, TOPO)
    np.testing.assert_allclose(imbalance(cupy.asarray(LOADS), PLACEMENT, TOPO), expected)
    np.testing.assert_allclose(imbalance(torch.tensor(LOADS, device="cuda"), PLACEMENT, TOPO),
                               expected)


# -- bad input: invariant 7 ------------------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    ([[4.0, np.nan, 6.0]], r"loads must be finite; found nan at \[layer 0, expert 1\]"),
    ([[4.0, 2.0, np.inf]], r"loads must be finite; found inf at \[layer 0, expert 2\]"),
    ([[-np.inf, 2.0, 6.0]], r"loads must be finite"),
    ([[4.0, -1.0, 6.0]], r"loads must be >= 0.*found -1\.0 at \[layer 0, expert 1\]"),
    (np.ones((1, 4)), r"loads has 4 experts per layer but 3 were expected"),
    (np.ones((1, 2)), r"loads has 2 experts per layer but 3 were expected"),
    (np.ones((2, 3)), r"loads has 2 layers but the placement has 1"),
    (np.ones((1, 1, 3)), r"loads must have shape \[num_layers, num_experts\]"),
    (np.float64(3.0), r"loads must have shape"),
    (np.ones((0, 3)), r"at least one layer"),
    (torch.tensor([[4.0, float("nan"), 6.0]]), r"loads must be finite"),
    (torch.tensor([[4, -2, 6]]), r"loads must be >= 0"),
])
def test_bad_loads_raise_value_error_naming_loads(bad, message):
    for metric in (imbalance, balancedness, summary_imbalance):
        with pytest.raises(ValueError, match=message):
            metric(bad, PLACEMENT, TOPO)
    with pytest.raises(ValueError, match=message):
        PLACEMENT.device_loads(bad)


@pytest.mark.parametrize("bad", [
    np.array([[True, False, True]]),
    np.array([["4", "2", "6"]]),
    np.array([[4 + 1j, 2, 6]]),
    np.array([[4, None, 6]], dtype=object),
    torch.tensor([[True, False, True]]),
    None,
], ids=["bool", "str", "complex", "object", "torch-bool", "none"])
def test_non_numeric_loads_raise_type_error_naming_loads(bad):
    with pytest.raises(TypeError, match=r"loads must hold real numbers"):
        imbalance(bad, PLACEMENT, TOPO)


def test_ragged_loads_raise_type_error_naming_loads():
    with pytest.raises(TypeError, match=r"loads"):
        imbalance([[4.0, 2.0, 6.0], [1.0]], PLACEMENT, TOPO)


def test_metrics_reject_a_placement_for_another_topology():
    other = Topology([Device(1.0, 2, 0), Device(2.0, 1, 0), Device(0.5, 2, 1)])  # same S
    for metric in (imbalance, balancedness, summary_imbalance):
        with pytest.raises(ValueError, match=r"placement does not match topology"):
            metric(LOADS, PLACEMENT, other)
        with pytest.raises(ValueError, match=r"placement does not match topology"):
            metric(LOADS, PLACEMENT, Topology.uniform(2, 2))


def test_metrics_reject_arguments_of_the_wrong_type():
    for metric in (imbalance, balancedness, summary_imbalance):
        with pytest.raises(TypeError, match=r"topology must be a moebalance.Topology"):
            metric(LOADS, PLACEMENT, TOPO.to_dict())
        with pytest.raises(TypeError, match=r"placement must be a moebalance.Placement"):
            metric(LOADS, PLACEMENT.phy2log, TOPO)



# -- per-step imbalance ---------------------------------------------------------------------------


def test_step_imbalance_is_each_steps_summary_and_the_resplit_never_worse(rng):
    from moebalance import plan, step_imbalance
    from moebalance.lab.bench.per_step import best_resplit

    topo = Topology.from_arrays([1.0, 1.0, 0.5, 0.5], [3, 3, 3, 3])
    counts = rng.gamma(0.7, 100.0, size=(15, 2, 8))
    counts[4] = 0.0                                    # a step with no tokens counts as 1.0
    p = plan(counts, topo)
    static = step_imbalance(counts, p, topo, resplit=False)
    resplit = step_imbalance(counts, p, topo)
    assert static.shape == resplit.shape == (15,)
    assert static[4] == resplit[4] == 1.0
    assert np.allclose(static, [summary_imbalance(counts[t], p, topo) if t != 4 else 1.0
                                for t in range(15)])
    assert (resplit <= static + 1e-9).all()
    # no re-split beats the best split over the same replicas (a linear program per layer)
    for t in (0, 7, 14):
        ideal = (counts[t].sum(axis=1) / topo.speed.sum()).sum()
        best = sum(best_resplit(counts[t, layer], p.phy2log[layer], topo)[0] for layer in range(2))
        assert resplit[t] >= best / ideal - 1e-9
    # one layer: [T, E] counts are read as [T, 1, E]
    one = plan(counts[:, :1], topo)
    assert np.allclose(step_imbalance(counts[:, 0], one, topo),
                       step_imbalance(counts[:, :1], one, topo))


def test_step_imbalance_names_the_argument_at_fault(rng):
    from moebalance import plan, step_imbalance

    topo = Topology.from_arrays([1.0, 1.0], [3, 3])
    counts = rng.gamma(0.7, 100.0, size=(5, 2, 4))
    p = plan(counts, topo)
    with pytest.raises(ValueError, match="counts_TLE must have shape \\[steps, 2, 4\\]"):
        step_imbalance(counts[:, :, :3], p, topo)
    with pytest.raises(ValueError, match="counts_TLE"):
        step_imbalance(-counts, p, topo)
    with pytest.raises(ValueError, match="does not match topology"):
        step_imbalance(counts, p, Topology.from_arrays([1.0, 1.0], [4, 2]))
    with pytest.raises(TypeError, match="placement must be"):
        step_imbalance(counts, p.phy2log, topo)
