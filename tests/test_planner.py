"""plan(): DESIGN invariants 1, 5 and 7, reference == Numba, near-optimality on tiny instances."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from strategies import loads as loads_strategy
from strategies import placement_cases, topologies

import moebalance as mb
from moebalance.planner import MoveCost


def _device_times(loads, p: mb.Placement, topo: mb.Topology) -> np.ndarray:
    return p.device_loads(loads) / topo.speed


def _zipf_loads(rng, num_layers, num_experts, exponent=1.0, tokens=65536.0):
    out = np.empty((num_layers, num_experts))
    for layer in range(num_layers):
        popularity = np.arange(1, num_experts + 1) ** -exponent * rng.lognormal(0, 0.5, num_experts)
        out[layer] = rng.permutation(popularity / popularity.sum() * tokens)
    return out


# -- invariant 1: every plan is a valid placement ------------------------------------------------


@given(case=placement_cases(max_devices=6, max_slots=4, max_layers=3))
def test_plan_is_valid_placement(case):
    topo, _, loads = case
    p = mb.plan(loads, topo)
    p.validate(topo)
    assert p.phy2log.shape == (loads.shape[0], topo.num_slots)
    assert np.all(p.phy2log >= 0)  # every slot holds a real expert
    assert np.all(p.replicas <= topo.num_devices)
    assert np.all(mb.imbalance(loads, p, topo) >= 1.0 - 1e-9)


@given(case=placement_cases(max_devices=5, max_slots=4, max_layers=2), data=st.data())
def test_max_moves_is_never_exceeded(case, data):
    topo, previous, loads = case
    max_moves = data.draw(st.integers(0, previous.phy2log.size))
    before = previous.phy2log.copy(), previous.share.copy()
    p = mb.plan(loads, topo, previous=previous, max_moves=max_moves)
    p.validate(topo)
    assert p.moves_from(previous) <= max_moves
    np.testing.assert_array_equal(previous.phy2log, before[0])  # previous is never modified
    np.testing.assert_array_equal(previous.share, before[1])


def test_replan_never_stays_far_above_a_fresh_plan(rng):
    # 2 slots on each of 144 devices: the repair's one-replica moves cannot reach the fresh
    # layout; the re-plan then takes the fresh plan renamed after the placement in service.
    from moebalance.planner.repair import REPAIR_SHORTFALL

    topo = mb.Topology.from_arrays(np.ones(144), [2] * 144)
    w0 = rng.lognormal(0.0, 1.0, size=(6, 256)) * 1000
    previous = mb.plan(w0, topo)
    w1 = w0 * rng.lognormal(0.0, 0.2, size=w0.shape)
    fresh, again = mb.plan(w1, topo), mb.plan(w1, topo, previous=previous)
    assert (mb.imbalance(w1, again, topo)
            <= mb.imbalance(w1, fresh, topo) * (1 + REPAIR_SHORTFALL) + 1e-9).all()
    # renamed, not moved wholesale; and a budget still binds
    assert again.moves_from(previous) < fresh.moves_from(previous)
    budget = again.moves_from(previous) // 3
    capped = mb.plan(w1, topo, previous=previous, max_moves=budget)
    assert capped.moves_from(previous) <= budget


def test_zero_move_budget_keeps_every_device_contents(rng):
    topo = mb.Topology.from_arrays([1.0, 2.0, 0.5, 1.0], [3, 2, 4, 3])
    w = _zipf_loads(rng, 4, 8)
    previous = mb.plan(w, topo)
    p = mb.plan(w * rng.lognormal(0, 0.3, w.shape), topo, previous=previous, max_moves=0)
    assert p.moves_from(previous) == 0
    for g in range(topo.num_devices):
        slots = topo.device_slots(g)
        for layer in range(4):
            assert set(p.phy2log[layer, slots]) == set(previous.phy2log[layer, slots])


def test_unchanged_loads_move_nothing(rng):
    topo = mb.Topology.uniform(16, 5, devices_per_node=4)
    w = _zipf_loads(rng, 6, 64)
    previous = mb.plan(w, topo)
    assert mb.plan(w, topo, previous=previous).moves_from(previous) == 0


# -- the two executions compute the same function ------------------------------------------------


@settings(max_examples=15)
@given(case=placement_cases(max_devices=5, max_slots=4, max_layers=2), data=st.data())
def test_reference_equals_numba(case, data):
    topo, previous, loads = case
    for kwargs in ({}, {"previous": previous},
                   {"previous": previous, "max_moves": data.draw(st.integers(0, 6))}):
        ref = mb.plan(loads, topo, backend="numpy", **kwargs)
        fast = mb.plan(loads, topo, backend="numba", **kwargs)
        np.testing.assert_array_equal(ref.phy2log, fast.phy2log)
        np.testing.assert_allclose(ref.share, fast.share, rtol=0, atol=1e-12)


def test_reference_equals_numba_at_moderate_size(rng):
    topo = mb.Topology.from_arrays([1.0, 0.5] * 8, [4, 6] * 8, np.arange(16) // 4)
    w = _zipf_loads(rng, 2, 48)
    for kwargs in ({}, {"previous": mb.plan(w, topo), "max_moves": 10}):
        w2 = w * rng.lognormal(0, 0.1, w.shape)
        ref = mb.plan(w2, topo, backend="numpy", polish=2, **kwargs)
        fast = mb.plan(w2, topo, backend="numba", polish=2, **kwargs)
        np.testing.assert_array_equal(ref.phy2log, fast.phy2log)
        np.testing.assert_allclose(ref.share, fast.share, rtol=0, atol=1e-12)


# -- quality -------------------------------------------------------------------------------------


def _optimal_time(w, speed, slots) -> float:
    """The best achievable max(load/speed) by MILP: x[e,g] expert e on device g (binary),
    y[e,g] its tokens there, T the time; each device holds exactly its slots."""
    E, G = len(w), len(speed)
    nx = E * G
    n = 2 * nx + 1
    rows, lo, hi = [], [], []

    def add(coeffs, low, high):
        row = np.zeros(n)
        for i, c in coeffs:
            row[i] = c
        rows.append(row)
        lo.append(low)
        hi.append(high)

    for g in range(G):
        add([(e * G + g, 1) for e in range(E)], slots[g], slots[g])
        add([(nx + e * G + g, 1) for e in range(E)] + [(n - 1, -speed[g])], -np.inf, 0)
    for e in range(E):
        add([(e * G + g, 1) for g in range(G)], 1, np.inf)
        add([(nx + e * G + g, 1) for g in range(G)], w[e], w[e])
        for g in range(G):
            add([(nx + e * G + g, 1), (e * G + g, -w[e])], -np.inf, 0)
    cost = np.zeros(n)
    cost[-1] = 1
    res = milp(cost, constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=np.r_[np.ones(nx), np.zeros(nx + 1)],
               bounds=Bounds(np.zeros(n), np.r_[np.ones(nx), np.full(nx + 1, np.inf)]))
    assert res.success, res.message
    return float(res.x[-1])


def test_within_two_percent_of_optimum_on_tiny_instances():
    rng = np.random.default_rng(7)
    checked = 0
    while checked < 60:
        G = int(rng.integers(1, 4))
        E = int(rng.integers(1, 7))
        slots = rng.integers(1, E + 1, G)
        if slots.sum() < E:
            continue
        speed = rng.choice([0.5, 1.0, 1.5, 2.0], G)
        w = rng.integers(0, 100, E) * rng.lognormal(0, 1, E)
        if w.sum() == 0:
            continue
        topo = mb.Topology.from_arrays(speed, slots)
        p = mb.plan(w, topo)
        worst = _device_times(w[None], p, topo).max()
        best = _optimal_time(w, speed, slots)
        assert worst <= best * 1.02 + 1e-9, (w, speed, slots, worst, best)
        checked += 1


@given(case=placement_cases(max_devices=5, max_slots=4, max_layers=1))
def test_shares_are_optimal_for_the_chosen_slots(case):
    """Given which device holds which expert, no other split of tokens finishes earlier (LP)."""
    topo, _, loads = case
    p = mb.plan(loads, topo)
    w = loads[0]
    S, G = topo.num_slots, topo.num_devices
    # variables: tokens per slot x[S], then T; minimise T
    cost = np.r_[np.zeros(S), 1.0]
    a_eq = np.zeros((p.num_experts, S + 1))
    a_eq[p.phy2log[0], np.arange(S)] = 1.0
    a_ub = np.zeros((G, S + 1))
    a_ub[topo.slot_device, np.arange(S)] = 1.0
    a_ub[:, -1] = -topo.speed
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(G), A_eq=a_eq, b_eq=w, bounds=(0, None))
    assert res.status == 0
    achieved = _device_times(loads, p, topo).max()
    assert achieved <= res.x[-1] * (1 + 1e-3) + 1e-9


@pytest.mark.parametrize("speed,slots", [([1.0] * 16, [5] * 16), ([1.0, 0.5] * 8, [4, 6] * 8),
                                         ([1.0] * 16, [5, 4] * 8)])
def test_balance_on_skewed_loads(rng, speed, slots):
    topo = mb.Topology.from_arrays(speed, slots, np.arange(16) // 4)
    w = _zipf_loads(rng, 8, 64, exponent=1.0)
    p = mb.plan(w, topo)
    assert mb.summary_imbalance(w, p, topo) < 1.05


def test_drift_moves_few_experts_and_stays_balanced(rng):
    topo = mb.Topology.uniform(16, 5, devices_per_node=4)
    w = _zipf_loads(rng, 8, 64)
    previous = mb.plan(w, topo)
    drifted = w * rng.lognormal(0, 0.05, w.shape)
    p = mb.plan(drifted, topo, previous=previous)
    fresh = mb.plan(drifted, topo)
    assert p.moves_from(previous) <= 0.10 * previous.phy2log.size
    assert (mb.summary_imbalance(drifted, p, topo)
            <= mb.summary_imbalance(drifted, fresh, topo) + 0.01)


def test_faster_devices_carry_more_tokens(rng):
    topo = mb.Topology.from_arrays([1.0, 3.0], [4, 4])
    w = rng.uniform(1, 10, (3, 6))
    p = mb.plan(w, topo)
    load = p.device_loads(w)
    assert np.all(load[:, 1] > load[:, 0])


def test_all_zero_layer_gets_a_valid_placement():
    topo = mb.Topology.uniform(3, 3)
    p = mb.plan(np.zeros((2, 5)), topo)
    p.validate(topo)
    np.testing.assert_array_equal(mb.imbalance(np.zeros((2, 5)), p, topo), 1.0)


def test_a_device_that_must_hold_every_expert_does_not_stall_packing():
    # Device 0 has a slot for each of the 5 experts, device 1 one slot, device 2 four: late
    # replicas once found free slots only on devices already holding their expert.
    topo = mb.Topology.from_arrays([2.0, 0.5, 1.0], [5, 1, 4])
    w = np.array([[0.110, 1.053, 1.981, 2.729, 0.539], [6.184, 0.267, 0.516, 2.547, 1.050]])
    for backend in ("numpy", "numba"):
        p = mb.plan(w, topo, backend=backend)
        p.validate(topo)
        assert sorted(p.phy2log[0, topo.device_slots(0)]) == [0, 1, 2, 3, 4]


def test_one_device_holds_every_expert():
    topo = mb.Topology.uniform(1, 4)
    p = mb.plan([[3.0, 1.0, 0.0, 2.0]], topo)
    assert sorted(p.phy2log[0]) == [0, 1, 2, 3]
    np.testing.assert_array_equal(p.share, 1.0)


# -- invariant 5: the same inputs give the same placement, in any process ------------------------


def _digest(p: mb.Placement) -> str:
    return hashlib.sha256(p.phy2log.tobytes() + p.share.tobytes()).hexdigest()


_DIGEST_SCRIPT = """
import numpy as np, hashlib, moebalance as mb
rng = np.random.default_rng(3)
w = rng.lognormal(0, 1, (4, 40)) * 100
topo = mb.Topology.from_arrays([1.0, 0.5, 2.0, 1.0, 1.0], [10, 12, 8, 10, 9], [0, 0, 1, 1, 1])
p = mb.plan(w, topo)
q = mb.plan(w * rng.lognormal(0, 0.2, w.shape), topo, previous=p, max_moves=7)
print(hashlib.sha256(p.phy2log.tobytes() + p.share.tobytes() + q.phy2log.tobytes()
                     + q.share.tobytes()).hexdigest())
"""


def test_deterministic_across_processes():
    # two interpreters at once: each spends its seconds importing torch
    procs = [subprocess.Popen([sys.executable, "-c", _DIGEST_SCRIPT], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err for _, err in outputs]
    digests = {out.strip() for out, _ in outputs}
    rng = np.random.default_rng(3)
    w = rng.lognormal(0, 1, (4, 40)) * 100
    topo = mb.Topology.from_arrays([1.0, 0.5, 2.0, 1.0, 1.0], [10, 12, 8, 10, 9], [0, 0, 1, 1, 1])
    p = mb.plan(w, topo)
    q = mb.plan(w * rng.lognormal(0, 0.2, w.shape), topo, previous=p, max_moves=7)
    here = hashlib.sha256(p.phy2log.tobytes() + p.share.tobytes() + q.phy2log.tobytes()
                          + q.share.tobytes()).hexdigest()
    assert digests == {here}


# -- inputs --------------------------------------------------------------------------------------


def test_accepts_torch_lists_and_integer_counts():
    topo = mb.Topology.uniform(2, 3)
    counts = [[5, 1, 0, 9], [2, 2, 2, 2]]
    a = mb.plan(np.array(counts), topo)
    b = mb.plan(torch.tensor(counts), topo)
    c = mb.plan(counts, topo)
    assert a == b == c


@pytest.mark.parametrize("loads,match", [
    (np.full((2, 4), np.nan), "loads must be finite"),
    (-np.ones((2, 4)), "loads must be >= 0"),
    (np.ones((2, 3, 4, 1)), r"loads must have shape \[num_layers, num_experts\]"),
    (np.full((3, 2, 4), np.nan), "loads must be finite"),
    (np.ones((2, 9)), "9 experts: every expert needs at least one slot"),
    (np.ones((2, 2)), "only 2 experts"),
])
def test_bad_loads_raise_clear_errors(loads, match):
    with pytest.raises(ValueError, match=match):
        mb.plan(loads, mb.Topology.uniform(2, 3))


def test_bad_arguments_raise_clear_errors():
    topo = mb.Topology.uniform(2, 3)
    w = np.ones((2, 4))
    p = mb.plan(w, topo)
    with pytest.raises(TypeError, match="topology must be a moebalance.Topology"):
        mb.plan(w, [1, 2])
    with pytest.raises(ValueError, match="previous placement has shape"):
        mb.plan(np.ones((3, 4)), topo, previous=p)
    with pytest.raises(ValueError, match="max_moves bounds moves away from a previous"):
        mb.plan(w, topo, max_moves=3)
    with pytest.raises(ValueError, match="max_moves must be an integer >= 0"):
        mb.plan(w, topo, previous=p, max_moves=-1)
    with pytest.raises(ValueError, match="tolerance must be in"):
        mb.plan(w, topo, previous=p, tolerance=2.0)
    with pytest.raises(ValueError, match="backend must be"):
        mb.plan(w, topo, backend="cupy")
    with pytest.raises(ValueError, match="polish must be an integer"):
        mb.plan(w, topo, polish=-2)
    other = mb.Topology.uniform(3, 2)
    with pytest.raises(ValueError):
        mb.plan(w, other, previous=p)


@given(topo=topologies(max_devices=4, max_slots=3))
def test_fewer_slots_than_experts_is_rejected(topo):
    with pytest.raises(ValueError, match="every expert needs at least one slot"):
        mb.plan(np.ones((1, topo.num_slots + 1)), topo)


# -- at the limit ----------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_perfect_balance_where_spare_slots_allow_a_valve_per_device(data):
    # Devices of equal speed and slots with S - E >= G: one valve per device can balance
    # exactly (wrap-around), so the hottest device is within 0.1% of the ideal.
    topo = data.draw(topologies(min_devices=2, max_devices=12, min_slots=2, max_slots=6,
                                heterogeneous=False))
    E = data.draw(st.integers(int(topo.slots.max()), topo.num_slots - topo.num_devices))
    loads = data.draw(st.integers(1, 3).flatmap(lambda L: loads_strategy(L, E)))
    p = mb.plan(loads, topo)
    p.validate(topo)
    assert np.all(mb.imbalance(loads, p, topo) <= 1.001)


def test_bench_sized_fresh_plans_are_exact_on_alike_clusters():
    from moebalance.lab import workloads

    w = workloads.synthetic_loads("heavy", 1, num_layers=6)
    for G, k in ((64, 5), (32, 9), (128, 3)):
        topo = mb.Topology.uniform(G, k, devices_per_node=8)
        p = mb.plan(w, topo)
        p.validate(topo)
        assert mb.imbalance(w, p, topo).max() <= 1.0 + 1e-9


# -- re-plans --------------------------------------------------------------------------------------


def test_replan_moves_few_slots_of_every_layer_and_never_rebuilds_one(rng):
    topo = mb.Topology.from_arrays([1.0] * 8 + [0.5] * 8, [4] * 8 + [6] * 8, np.arange(16) // 4)
    w = _zipf_loads(rng, 6, 56, exponent=0.6)
    previous = mb.plan(w, topo)
    drifted = w * rng.lognormal(0, 0.2, w.shape)
    p = mb.plan(drifted, topo, previous=previous)
    p.validate(topo)
    assert p.moves_per_layer(previous).max() <= 0.5 * topo.num_slots
    kept = mb.plan(drifted, topo, previous=previous, max_moves=0)
    assert mb.summary_imbalance(drifted, p, topo) < mb.summary_imbalance(drifted, kept, topo)


def test_move_cost_trades_moves_against_the_time_they_save(rng):
    topo = mb.Topology.uniform(16, 5, devices_per_node=4)
    w = _zipf_loads(rng, 6, 64)
    previous = mb.plan(w, topo)
    drifted = w * rng.lognormal(0, 0.2, w.shape)
    free = mb.plan(drifted, topo, previous=previous)
    cheap = mb.plan(drifted, topo, previous=previous,
                    move_cost=MoveCost(bytes_per_move=1.0, bandwidth=1e12, steps=1e6,
                                       step_seconds=1.0))
    dear = mb.plan(drifted, topo, previous=previous,
                   move_cost=MoveCost(bytes_per_move=617e6, bandwidth=1e6, steps=1,
                                      step_seconds=1e-3))
    assert cheap == free and free.moves_from(previous) > 0
    assert dear.moves_from(previous) == 0
    assert dear == mb.plan(drifted, topo, previous=previous, max_moves=0)
    assert MoveCost(617e6, 50e9, 200, 0.5).per_move == pytest.approx(617e6 / 50e9 / 100)


def test_spread_aware_plans_serve_the_steps_at_least_as_well(rng):
    from moebalance.planner import _jit
    from moebalance.planner.core import MAX_SWEEPS, devices_of

    topo = mb.Topology.from_arrays([1.0] * 4 + [0.5] * 2, [4] * 6)
    steps = rng.poisson(_zipf_loads(rng, 3, 20, tokens=2000.0)[None] * rng.lognormal(
        0, 0.4, (40, 3, 20))).astype(np.float64)
    mean = steps.mean(axis=0)
    k = _jit.kernels("numba")

    def served(p):
        return k.step_times(steps, devices_of(topo), p.phy2log.copy(), p.share.copy(),
                            MAX_SWEEPS)

    plain, aware = mb.plan(mean, topo), mb.plan(mean, topo, spread=steps)
    aware.validate(topo)
    assert np.all(served(aware) <= served(plain) + 1e-9)
    ref = mb.plan(mean, topo, spread=steps, backend="numpy")
    np.testing.assert_array_equal(ref.phy2log, aware.phy2log)


def test_move_cost_and_spread_reject_bad_arguments():
    topo = mb.Topology.uniform(2, 3)
    w = np.ones((2, 4))
    p = mb.plan(w, topo)
    with pytest.raises(ValueError, match=r"MoveCost\(bandwidth=...\) must be a finite number > 0"):
        MoveCost(1.0, 0.0, 1, 1.0)
    with pytest.raises(TypeError, match="move_cost must be a moebalance.planner.MoveCost"):
        mb.plan(w, topo, previous=p, move_cost=3.0)
    with pytest.raises(ValueError, match="move_cost prices moves away from a previous"):
        mb.plan(w, topo, move_cost=MoveCost(1.0, 1.0, 1, 1.0))
    with pytest.raises(ValueError, match=r"spread must be the per-step counts \[steps, 2, 4\]"):
        mb.plan(w, topo, spread=np.ones((2, 4)))


def test_kernel_lookup_follows_the_chosen_planner_backend(isolated_backends):
    from moebalance.backends import force_backend
    from moebalance.planner import _jit, fresh

    force_backend("planner", "numpy")
    assert _jit.kernels().plan_fresh is fresh.plan_fresh  # the plain-Python reference
    if mb.backends()["numba"]:
        force_backend("planner", "numba")
        assert _jit.kernels().plan_fresh is _jit.kernels("numba").plan_fresh
        assert _jit.kernels().plan_fresh is not fresh.plan_fresh
    with pytest.raises(ValueError, match="backend must be 'numba', 'numpy' or None"):
        _jit.kernels("cuda")


# -- the repair's searches against plain scans -----------------------------------------------------


def _plain_top_room(room, victim, tiny, need_victim, count):
    """Most room first, lower index on ties: a stable sort of the eligible devices."""
    eligible = [g for g in range(len(room))
                if room[g] > tiny and (victim[g] >= 0 or not need_victim)]
    return sorted(eligible, key=lambda g: -room[g])[:count]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_top_room_picks_the_devices_with_most_room(rng, backend):
    from moebalance.planner import _jit, repair

    k = _jit.kernels(backend)
    for G in (1, 3, 8, 9, 40):
        for _ in range(20):
            # rounded rooms, so that ties occur
            room = np.round(rng.normal(0.0, 2.0, G))
            victim = np.where(rng.random(G) < 0.6, rng.integers(0, 5, G), -1)
            recv, partners = k.top_room(room, victim, 1e-9)
            assert list(recv) == _plain_top_room(room, victim, 1e-9, True, repair.RECEIVERS)
            assert list(partners) == _plain_top_room(room, victim, 1e-9, False, repair.RECEIVERS)


def _plain_best_swap(w, topo, phy2log, share, room, partners, tiny):
    """Every (a, b) in slot order, the strictly best estimated gain kept."""
    best, best_gain = (-1, -1), tiny
    devices = [list(range(topo.slot_offsets[g], topo.slot_offsets[g + 1]))
               for g in range(topo.num_devices)]
    for h in range(topo.num_devices):
        over = -room[h]
        if over <= tiny:
            continue
        for a in devices[h]:
            pa = w[phy2log[a]] * share[a]
            for d in partners:
                if phy2log[a] in phy2log[devices[d]]:
                    continue
                for b in devices[d]:
                    pb = w[phy2log[b]] * share[b]
                    if pb >= pa or phy2log[b] in phy2log[devices[h]]:
                        continue
                    delta = pa - pb
                    gain = over - max(0.0, over - delta) - max(0.0, delta - room[d])
                    if gain > best_gain:
                        best, best_gain = (a, b), gain
    return best


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_best_swap_equals_a_plain_scan_of_every_pair(rng, backend):
    from moebalance.planner import _jit, core

    k = _jit.kernels(backend)
    found = 0
    for trial in range(40):
        G = int(rng.integers(2, 12))
        topo = mb.Topology.from_arrays(rng.choice([1.0, 0.5, 0.7], G), rng.integers(1, 5, G),
                                       np.zeros(G, dtype=int))
        E = int(rng.integers(int(topo.slots.max()), topo.num_slots + 1))
        w = np.round(rng.lognormal(3.0, 1.0, E))  # rounded, so that ties occur
        p = mb.plan(w * rng.lognormal(0.0, 0.5, E), topo)
        # writable, as the repair's working arrays are (Numba compiles read-only apart)
        phy2log, share = p.phy2log[0].copy(), p.share[0].copy()
        load = k.device_loads(w, core.devices_of(topo), phy2log, share)
        room = w.sum() / topo.speed.sum() * topo.speed - load
        tiny = 1e-12 * (load.sum() + 1.0)
        victim = np.full(G, -1)
        _, partners = k.top_room(room, victim, tiny)
        holds = np.zeros(G * E, dtype=bool)
        holds[topo.slot_device * E + phy2log] = True
        got = k.best_swap(w, core.devices_of(topo), phy2log, share, room, partners, holds, tiny)
        assert tuple(int(x) for x in got) == _plain_best_swap(w, topo, phy2log, share, room,
                                                               partners, tiny), trial
        found += got[0] >= 0
    assert found >= 10  # the cases exercise the search, not only its empty answer
