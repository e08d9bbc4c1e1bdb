"""Transient replicas in the simulator: the greedy copies, their loads and their charge."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moebalance.cli import main as cli
from moebalance.lab.sim.cluster import MODELS, ClusterSpec, GPUKind, ModelShape, cluster_preset
from moebalance.lab.sim.policies import MoebalancePeriodic, default_policies
from moebalance.lab.sim.run import simulate
from moebalance.lab.sim.stepmodel import BACKWARD_SHARE, StepModel
from moebalance.lab.sim.traces import generate_trace
from moebalance.planner import _jit

SMALL = ModelShape("small", num_layers=4, num_experts=16, top_k=2, hidden=64, ffn=128,
                   tokens_per_device=256, num_groups=4, non_moe_flops_per_token=1e6)
KIND = GPUKind("X", flops=1e12, memory=80e9, intra_bandwidth=100e9, inter_bandwidth=10e9,
               intra_latency=0.0, inter_latency=0.0, gemm_efficiency=1.0)


def _cluster(devices=8, per_node=4, kind=KIND) -> ClusterSpec:
    return ClusterSpec("test", "", ("X",) * devices, tuple(g // per_node for g in range(devices)),
                       {"X": kind})


def _devices(speed_G, node_G, slots, intra=450e9, inter=50e9) -> np.ndarray:
    G = len(speed_G)
    return np.stack([np.asarray(speed_G, dtype=np.float64), np.asarray(node_G, dtype=np.float64),
                     np.full(G, float(slots)), np.full(G, intra), np.full(G, inter)], axis=1)


def _placed(*arrays):
    """Read-only copies, as a ``Placement``'s and a ``Topology``'s arrays are: Numba compiles a
    kernel apart for read-only arrays, and the library only ever hands it those."""
    out = tuple(np.array(a) for a in arrays)
    for a in out:
        a.flags.writeable = False
    return out


def _random_layer(rng, G, E, extra):
    """A layer's slots: every expert once, ``extra`` experts twice, never twice on a device."""
    phy2log = np.concatenate([np.arange(E), rng.choice(E, extra, replace=False)])
    device = np.concatenate([rng.permutation(np.arange(E) % G), np.zeros(extra, dtype=np.int64)])
    for s in range(E, E + extra):
        first = device[np.flatnonzero(phy2log[:E] == phy2log[s])[0]]
        device[s] = (first + 1 + rng.integers(G - 1)) % G
    share = 1.0 / np.bincount(phy2log)[phy2log]
    return _placed(phy2log.astype(np.int64), share, device.astype(np.int64))


# -- the kernel -----------------------------------------------------------------------------------


def test_two_devices_hand_worked_copy_evens_the_load():
    # expert 0 (300 pairs) alone on device 0, expert 1 (100) on device 1, one node: a copy of
    # expert 0 on device 1 saves (300 - 200) pairs x 1 ms against 2 x 1 GB / 1 TB/s = 2 ms
    devices = _devices([1.0, 1.0], [0, 0], 1, intra=1e12)
    counts = np.array([[300.0, 100.0]])
    args = _placed([0, 1], [1.0, 1.0], [0, 1])
    for backend in ("numpy", "numba"):
        kernels = _jit.kernels(backend)
        load, seconds, copies = kernels.transient_loads(counts, counts, *args, devices,
                                                        np.array([1e-3, 1e9]))
        np.testing.assert_allclose(load, [[200.0, 200.0]])
        np.testing.assert_allclose(seconds, [[1e-3, 1e-3]])        # out of 0, into 1
        assert copies.tolist() == [1]
    # at 10 GB/s the round trip costs 200 ms, more than the 100 ms it saves: no copy
    slow = _devices([1.0, 1.0], [0, 0], 1, intra=1e10)
    load, seconds, copies = _jit.kernels("numba").transient_loads(
        counts, counts, *args, slow, np.array([1e-3, 1e9]))
    assert copies.tolist() == [0] and not seconds.any()
    np.testing.assert_allclose(load, [[300.0, 100.0]])


def test_a_copy_prefers_the_cheap_link_when_it_saves_as_much():
    # device 0 holds the hot expert; devices 1 (same node) and 2 (other node) are equally cold
    devices = _devices([1.0] * 3, [0, 0, 1], 1)
    counts = np.array([[400.0, 0.0, 0.0]])
    load, seconds, copies = _jit.kernels("numba").transient_loads(
        counts, counts, *_placed([0, 1, 2], np.ones(3), [0, 1, 2]), devices,
        np.array([1e-3, 1e9]))
    # two copies: the first to the node neighbour (NVLink), the second over the network
    assert copies.tolist() == [2]
    np.testing.assert_allclose(load, [[400 / 3] * 3])
    np.testing.assert_allclose(seconds[0], [1e9 / 450e9 + 1e9 / 50e9, 1e9 / 450e9, 1e9 / 50e9])


@pytest.mark.parametrize("guide", ["previous", "current"])
def test_copies_never_slow_the_slowest_device_and_keep_every_token(guide):
    rng = np.random.default_rng(7)
    G, E, T = 8, 24, 12
    phy2log, share, device = _random_layer(rng, G, E, 6)
    speed, = _placed(np.where(np.arange(G) < 4, 1.0, 0.4))
    counts = rng.gamma(0.4, 1.0, (T + 1, E)) * 50
    guide_TE = counts[:-1] if guide == "previous" else counts[1:]
    devices = _devices(speed, np.arange(G) // 4, 2)
    unit_bytes = np.array([1e-3, 88e6])
    ref = _jit.kernels("numpy").transient_loads(counts[1:], guide_TE, phy2log, share, device,
                                                devices, unit_bytes)
    fast = _jit.kernels("numba").transient_loads(counts[1:], guide_TE, phy2log, share, device,
                                                 devices, unit_bytes)
    for a, b in zip(ref, fast):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-9)
    load, seconds, copies = fast
    base = _jit.kernels("numba").resplit_loads(counts[1:], phy2log, share, speed, device, 2, True)
    assert copies.sum() > 0 and np.all(copies <= 2 * G)
    np.testing.assert_allclose(load.sum(axis=1), counts[1:].sum(axis=1))
    assert np.all((load / speed).max(axis=1) <= (base / speed).max(axis=1) * (1 + 1e-9))
    if guide == "current":   # chosen on the step itself: the slowest device gains where copied
        gained = (load / speed).max(axis=1) < (base / speed).max(axis=1) * (1 - 1e-6)
        assert np.array_equal(gained, copies > 0)
    assert np.all(seconds[copies == 0] == 0) and np.all(seconds[copies > 0].max(axis=1) > 0)


# -- the step model's charge ----------------------------------------------------------------------


def test_copies_made_ahead_are_exposed_beyond_the_stages_compute():
    sm = StepModel(_cluster(4, 4), SMALL)          # one stage of 4 layers
    loads = np.full((1, 4, 4), 128.0)
    terms = sm.layer_terms(loads)
    window = float((terms["expert_compute"] + terms["non_moe"]).sum())
    copy = np.zeros((1, 4, 4))
    copy[0, :, 2] = 0.4 * window / 4               # device 2: copies and reduces 0.8 x window
    assert sm.transient_seconds(copy, loads, terms, "previous") == pytest.approx([0.0])
    copy[0, :, 2] = 0.75 * window / 4              # 1.5 x window: half a window exposed
    assert sm.transient_seconds(copy, loads, terms, "previous") == pytest.approx([0.5 * window])


def test_copies_on_the_critical_path_add_to_the_dispatch_and_the_backward():
    sm = StepModel(_cluster(4, 4), SMALL)
    loads = np.full((1, 4, 4), 128.0)
    loads[0, 0] = [200.0, 128.0, 100.0, 84.0]
    terms = sm.layer_terms(loads)
    a = sm.exchange_seconds(loads)                   # [1, 4, 4] one exchange per device
    window = float((terms["expert_compute"] + terms["non_moe"]).sum())
    copy = np.zeros((1, 4, 4))
    copy[0, 0, 3] = c = 10 * a[0, 0].max()          # the coolest device's copy on layer 0
    forward = a[0, 0, 3] + c - a[0, 0].max()
    backward = max(c - BACKWARD_SHARE * window, 0.0)
    got = sm.transient_seconds(copy, loads, terms, "current")
    assert got == pytest.approx([forward + backward])
    with pytest.raises(ValueError, match="guide"):
        sm.transient_seconds(copy, loads, terms, "next")


# -- the policy and the loop ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    cluster = _cluster()
    counts = generate_trace(50, num_layers=4, num_experts=16, num_groups=4, top_k=2,
                            tokens=2048, skew="heavy", seed=3)
    policies = [MoebalancePeriodic(10, resplit=True),
                MoebalancePeriodic(10, resplit=True, transient=0),
                MoebalancePeriodic(10, resplit=True, transient=1, guide="previous"),
                MoebalancePeriodic(10, resplit=True, transient=2, guide="current")]
    return simulate(counts, cluster, SMALL, policies, warmup=10).runs


def test_no_transient_slots_run_exactly_as_before(runs):
    before, zero = runs[:2]
    assert np.array_equal(before.step_seconds, zero.step_seconds)
    assert np.array_equal(before.imbalance, zero.imbalance)
    assert not zero.terms["transient"].any() and not zero.copies.any()
    assert [p.name for p in default_policies(10, 10, None)] == \
        [p.name for p in default_policies(10, 10, None, transient=0)]


def test_transient_rows_make_copies_charge_them_and_never_raise_the_imbalance(runs):
    resplit, _, ahead, current = runs
    for run in (ahead, current):
        assert run.copies.sum() > 0
        np.testing.assert_allclose(sum(run.terms.values()), run.step_seconds)
        assert np.all(run.imbalance <= resplit.imbalance * (1 + 1e-9))
        assert run.terms["transient"].min() >= 0
    # on the critical path the forward copies add to the dispatch: charged at every copy
    assert np.all(current.terms["transient"][current.copies > 0] > 0)
    assert "2 transient (current)" in current.name


def test_copies_that_cost_more_than_they_save_are_not_made():
    slow = GPUKind("X", flops=1e12, memory=80e9, intra_bandwidth=1.0, inter_bandwidth=1.0,
                   intra_latency=0.0, inter_latency=0.0, gemm_efficiency=1.0)
    counts = generate_trace(30, num_layers=4, num_experts=16, num_groups=4, top_k=2,
                            tokens=2048, skew="heavy", seed=3)
    sim = simulate(counts, _cluster(kind=slow), SMALL,
                   [MoebalancePeriodic(10, resplit=True),
                    MoebalancePeriodic(10, resplit=True, transient=2, guide="current")],
                   warmup=10)
    base, copied = sim.runs
    assert not copied.copies.any() and not copied.terms["transient"].any()
    np.testing.assert_allclose(copied.step_seconds, base.step_seconds, rtol=1e-12)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(transient=1), ValueError, "needs resplit=True"),
    (dict(transient=-1, resplit=True), ValueError, "transient"),
    (dict(transient=1.5, resplit=True), TypeError, "transient"),
    (dict(transient=1, resplit=True, guide="next"), ValueError, "guide must be one of"),
])
def test_bad_transient_settings_name_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        MoebalancePeriodic(10, **kwargs)


def test_transient_slots_must_fit_beside_the_expert_slots():
    model = MODELS["deepseek-v3"]
    h100 = cluster_preset("h100-64")
    fit = h100.transient_slots(model)
    # 28 GB for experts, 5 slots of 2.82 GB taken; a transient slot holds 4 x 0.18 GB
    expected = (80e9 * 0.35 - 5 * model.expert_params * 16 * 4) // (2 * model.copy_bytes * 4)
    assert fit.tolist() == [int(expected)] * 64
    h100.check_transient(model, int(expected))
    with pytest.raises(ValueError, match="lower transient"):
        h100.check_transient(model, int(expected) + 1)


def test_simulate_command_adds_a_row_per_guide(tmp_path, capsys):
    model = tmp_path / "roomy.json"       # Mixtral with room for a transient slot beside its own
    model.write_text(json.dumps({"base": "mixtral-8x7b", "expert_memory_fraction": 0.75}))
    rc = cli.main(["simulate", "--model", str(model), "--cluster", "h100-8", "--steps", "20",
                   "--every", "10", "--transient", "1", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "1 transient (previous)" in text and "1 transient (current)" in text
    result = json.loads((tmp_path / "results.json").read_text())["results"][0]
    assert len(result["summaries"]) == 7 and "copies_per_step" in result["summaries"][0]
    assert cli.main(["simulate", "--model", str(model), "--cluster", "h100-8", "--transient",
                     "5", "--no-plots", "--out", str(tmp_path)]) == 2
    assert "--transient: cluster 'h100-8': transient=5" in capsys.readouterr().err
