"""The simulator with device speeds that change at a step (a straggler): the cluster's speed
schedule, the step model at the changed speeds on hand-worked cases, policies that plan for the
nominal speeds against one that tracks the measured ones, and ``moebalance simulate
--straggler``."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

import moebalance as mb
from moebalance.cli import main as cli
from moebalance.lab.sim.cluster import ClusterSpec, GPUKind, ModelShape, load_cluster
from moebalance.lab.sim.policies import MoebalancePeriodic, Oracle
from moebalance.lab.sim.run import simulate
from moebalance.lab.sim.stepmodel import StepModel
from moebalance.lab.sim.traces import generate_trace

SMALL = ModelShape("small", num_layers=4, num_experts=16, top_k=2, hidden=64, ffn=128,
                   tokens_per_device=256, num_groups=4, non_moe_flops_per_token=1e6)
KIND = GPUKind("X", flops=1e12, memory=80e9, intra_bandwidth=100e9, inter_bandwidth=10e9,
               intra_latency=0.0, inter_latency=0.0, gemm_efficiency=1.0)


def _cluster(devices: int, changes=()) -> ClusterSpec:
    return ClusterSpec("test", "", ("X",) * devices, (0,) * devices, {"X": KIND}, tuple(changes))


# -- the schedule ---------------------------------------------------------------------------------


def test_speed_factors_follow_the_schedule_and_a_later_change_replaces_an_earlier():
    cluster = _cluster(4, [(8, 2, 1.0), (5, 2, 0.5), (6, 0, 0.25)])
    assert cluster.speed_changes == ((5, 2, 0.5), (6, 0, 0.25), (8, 2, 1.0))
    factors = cluster.speed_factors(10)
    expected = np.ones((10, 4))
    expected[5:8, 2] = 0.5
    expected[6:, 0] = 0.25
    np.testing.assert_array_equal(factors, expected)
    # the planner's view stays nominal
    np.testing.assert_array_equal(cluster.topology(SMALL).speed, np.ones(4))


def test_speed_changes_round_trip_through_json_and_toml(tmp_path):
    cluster = _cluster(4, [(5, 2, 0.5)])
    path = tmp_path / "slow.json"
    data = cluster.to_dict()
    data["kinds"]["X"].pop("name")
    path.write_text(json.dumps(data))
    assert load_cluster(path).speed_changes == ((5, 2, 0.5),)
    toml = tmp_path / "slow.toml"
    toml.write_text('[[nodes]]\nkind = "H100"\ndevices = 4\n'
                    '[[speed_changes]]\nstep = 30\ndevice = 3\nfactor = 0.5\n')
    assert load_cluster(toml).speed_changes == ((30, 3, 0.5),)
    assert _cluster(4).with_speed_changes([(1, 0, 0.9)]).speed_changes == ((1, 0, 0.9),)


@pytest.mark.parametrize("changes, message", [
    ([(5, 4, 0.5)], "device 4 is not in the cluster's 4 devices"),
    ([(5, 1, 0.0)], "factor must be a finite number > 0"),
    ([(-1, 1, 0.5)], "step must be an integer >= 0"),
    ([(5, 1)], r"must be \(step, device, factor\)"),
])
def test_bad_speed_changes_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        _cluster(4, changes)
    with pytest.raises(ValueError, match="exactly the keys"):
        ClusterSpec.from_dict({"nodes": [{"kind": "H100", "devices": 2}],
                           "speed_changes": [{"step": 1, "device": 0}]})


# -- the step model at changed speeds -------------------------------------------------------------


def test_compute_and_rest_use_the_speed_of_the_step():
    sm = StepModel(_cluster(2), SMALL)
    loads = np.array([[[300.0, 212.0]], [[300.0, 212.0]]])          # 2 steps, 1 layer
    factors = np.array([[1.0, 1.0], [1.0, 0.5]])                      # device 1 halves at step 1
    per_pair = SMALL.flops_per_pair
    compute = sm.compute_seconds(loads, factors)
    assert compute[0, 0] == pytest.approx(300 * per_pair / 1e12)
    assert compute[1, 0] == pytest.approx(max(300 * per_pair / 1e12, 212 * per_pair / 0.5e12))
    rest = sm.layer_terms(loads, factors)["non_moe"]
    assert rest[:, 0] == pytest.approx([1e6 * 256 / 1e12, 1e6 * 256 / 0.5e12])
    # imbalance at the speeds run: hottest max(300 / 1, 100 / 0.5) = 300 over 400 / 1.5
    imbalance = sm.imbalance(np.array([[[300.0, 100.0]]]), np.array([[1.0, 0.5]]))
    assert imbalance[0] == pytest.approx(300 / (400 / 1.5))
    np.testing.assert_allclose(sm.compute_seconds(loads),
                               sm.compute_seconds(loads, np.ones((2, 2))))


# -- policies -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def straggler_run():
    cluster = _cluster(8, [(30, 0, 0.4)])
    counts = generate_trace(80, num_layers=4, num_experts=16, num_groups=4, top_k=2,
                            tokens=2048, seed=3)
    policies = [MoebalancePeriodic(10, resplit=True),
                MoebalancePeriodic(10, resplit=True, speeds=mb.SpeedTracker(5, min_change=0.05)),
                Oracle()]
    # no rest-of-layer term: the step is the experts and the all-to-all
    return simulate(counts, cluster, replace(SMALL, non_moe_flops_per_token=0.0), policies,
                    warmup=10)


def test_tracking_policy_reacts_to_the_straggler_and_beats_the_fixed_one(straggler_run):
    fixed, tracked, oracle = straggler_run.runs
    assert tracked.name.endswith("+ speed tracking")
    # steady speeds before step 30: the tracker never re-plans, both runs are the same
    np.testing.assert_allclose(tracked.step_seconds[:20], fixed.step_seconds[:20])
    assert [r["step"] for r in fixed.replans] == [20, 30, 40, 50, 60, 70]
    # the first check after the slowdown (step 35 folds steps 30-34) re-plans at once
    assert 35 in [r["step"] for r in tracked.replans]
    after = slice(45 - 10, None)                     # steps 45.. once the smoothing settled
    assert tracked.step_seconds[after].mean() < 0.6 * fixed.step_seconds[after].mean()
    assert oracle.step_seconds[after].mean() <= tracked.step_seconds[after].mean() + 1e-12
    # the fixed run's straggler holds its nominal share: its imbalance at the speeds run
    # is well above the tracked run's
    assert fixed.imbalance[after].mean() > 1.5 and tracked.imbalance[after].mean() < 1.3


def test_tracker_is_fresh_per_run_and_sees_only_past_steps():
    cluster = _cluster(4, [(12, 1, 0.5)])
    counts = generate_trace(30, num_layers=4, num_experts=16, num_groups=4, top_k=2, tokens=512)
    policy = MoebalancePeriodic(50, resplit=True, speeds=mb.SpeedTracker(4, min_change=0.05))
    first = simulate(counts, cluster, SMALL, [policy], warmup=5).runs[0]
    # check at 12 folds steps 0-11 (steady); at 16 steps 12-15 (slowed): the first re-plan is
    # at 16 (later checks may follow while the smoothed speed settles)
    assert [r["step"] for r in first.replans][0] == 16
    assert policy.topology.speed[1] < 0.7 and policy.tracker.steps == 0
    second = simulate(counts, cluster, SMALL, [policy], warmup=5).runs[0]
    np.testing.assert_array_equal(first.step_seconds, second.step_seconds)
    with pytest.raises(TypeError, match="speeds must be a moebalance.SpeedTracker"):
        MoebalancePeriodic(5, speeds=0.5)
    with pytest.raises(ValueError, match="fall after the trace's last step"):
        simulate(counts, _cluster(4, [(30, 1, 0.5)]), SMALL, [Oracle()], warmup=5)


# -- the command ----------------------------------------------------------------------------------


def test_simulate_command_straggler_adds_the_tracking_row(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = cli.main(["simulate", "--model", "mixtral-8x7b", "--cluster", "h100-a100-64",
                   "--steps", "40", "--every", "10", "--straggler", "25:3:0.5",
                   "--speed-every", "5", "--no-plots", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "+ speed tracking" in text and "device 3 at 0.5x from step 25" in text
    result = json.loads((out / "results.json").read_text())["results"][0]
    assert result["cluster"]["speed_changes"] == [{"step": 25, "device": 3, "factor": 0.5}]
    names = [s["policy"] for s in result["summaries"]]
    assert len(names) == 6 and names[-2].endswith("+ speed tracking")


def test_simulate_command_straggler_flag_is_parsed_as_three_fields(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["simulate", "--straggler", "25:3", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "--straggler: expected STEP:DEVICE:FACTOR" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--straggler", "25:99:0.5"], "--straggler: cluster"),
    (["--straggler", "999:1:0.5", "--steps", "20", "--every", "10"], "fall after"),
])
def test_simulate_command_straggler_errors_are_one_line(argv, message, tmp_path, capsys):
    assert cli.main(["simulate", "--model", "mixtral-8x7b", "--cluster", "h100-a100-64", *argv,
                     "--no-plots", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moebalance simulate: error:") and message in err
    assert len(err.splitlines()) == 1
