"""The simulator: cluster and model descriptions, the trace generator and its fit, the step
model's formulas against hand-worked cases, the policies, the loop and ``moebalance simulate``."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

import moebalance as mb
from moebalance.cli import main as cli
from moebalance.lab.sim.cluster import (
    CLUSTER_PRESETS,
    GPU_KINDS,
    MODELS,
    ClusterSpec,
    GPUKind,
    ModelShape,
    cluster_preset,
    load_cluster,
    load_model,
)
from moebalance.lab.sim.policies import (
    EPLBPeriodic,
    MoebalancePeriodic,
    Oracle,
    StaticUniform,
    default_policies,
)
from moebalance.lab.sim.run import move_price, scale_trace, simulate
from moebalance.lab.sim.stepmodel import EXCHANGES, StepModel
from moebalance.lab.sim.traces import (
    Dynamics,
    default_dynamics,
    fit_dynamics,
    generate_trace,
    read_trace,
)
from moebalance.planner import _jit
from moebalance.planner.core import MAX_SWEEPS, devices_of

# A small model: 4 layers of 16 experts, top-2; every device holds every layer.
SMALL = ModelShape("small", num_layers=4, num_experts=16, top_k=2, hidden=64, ffn=128,
                   tokens_per_device=256, num_groups=4, non_moe_flops_per_token=1e6)
KIND = GPUKind("X", flops=1e12, memory=80e9, intra_bandwidth=100e9, inter_bandwidth=10e9,
               intra_latency=0.0, inter_latency=0.0, gemm_efficiency=1.0)


def _cluster(kinds, nodes, catalogue=None) -> ClusterSpec:
    return ClusterSpec("test", "", tuple(kinds), tuple(nodes), catalogue or {"X": KIND})


# -- clusters and models --------------------------------------------------------------------------


def test_presets_derive_slots_from_memory_and_speed_from_throughput():
    model = MODELS["deepseek-v3"]
    mixed = cluster_preset("h100-a100-64")
    topology = mixed.topology(model)
    assert topology.num_devices == 64 and topology.num_slots >= model.num_experts
    ratio = GPU_KINDS["A100"].expert_flops / GPU_KINDS["H100"].expert_flops
    assert topology.speed[:32] == pytest.approx(1.0) and topology.speed[32:] == pytest.approx(ratio)
    assert list(topology.node) == [g // 8 for g in range(64)]
    # at 1024 devices memory is not the limit: the cap (one even spread with redundancy) is
    assert cluster_preset("h100-1024").slots(model).tolist() == [1] * 1024
    assert all(kind.source for kind in GPU_KINDS.values())


def test_cluster_round_trips_through_json_and_toml(tmp_path):
    mixed = CLUSTER_PRESETS["h200-h100-64"]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(mixed.to_dict()))
    back = load_cluster(path)
    assert back.kinds == mixed.kinds and back.nodes == mixed.nodes
    toml = tmp_path / "lab.toml"
    toml.write_text('name = "lab"\n[kinds.Slow]\nflops = 1e14\nmemory = 4.8e10\n'
                    'intra_bandwidth = 3e10\ninter_bandwidth = 1e10\n'
                    '[[nodes]]\nkind = "H100"\ndevices = 4\n[[nodes]]\nkind = "Slow"\ndevices = '
                    '4\n')
    lab = load_cluster(toml)
    assert lab.kinds == ("H100",) * 4 + ("Slow",) * 4 and lab.nodes == (0,) * 4 + (1,) * 4
    assert lab.catalogue["Slow"].flops == 1e14


@pytest.mark.parametrize("data, message", [
    ({"nodes": []}, "non-empty list 'nodes'"),
    ({"nodes": [{"kind": "B200", "devices": 8}]}, "unknown device kind"),
    ({"nodes": [{"kind": "H100", "devices": 0}]}, "devices"),
    ({"kinds": {"H100": {"flopz": 1}}, "nodes": [{"kind": "H100", "devices": 1}]}, "flopz"),
    ({"kinds": {"New": {"flops": 1e12}}, "nodes": [{"kind": "New", "devices": 1}]}, "incomplete"),
    ({"kinds": {"H100": {"flops": -1}}, "nodes": [{"kind": "H100", "devices": 1}]}, "flops"),
])
def test_bad_cluster_descriptions_name_the_field(data, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec.from_dict(data)


def test_cluster_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read cluster file"):
        load_cluster(tmp_path / "missing.json")
    bad = tmp_path / "bad.toml"
    bad.write_text("nodes = [")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_cluster(bad)


def test_a_model_that_does_not_fit_says_what_to_change():
    with pytest.raises(ValueError, match="do not fit.*add devices"):
        cluster_preset("h100-8").slots(MODELS["deepseek-v3"])


def test_model_files_start_from_a_preset_and_are_checked(tmp_path):
    path = tmp_path / "v3-short.json"
    path.write_text(json.dumps({"base": "deepseek-v3", "tokens_per_device": 4096}))
    model = load_model(path)
    assert model.tokens_per_device == 4096 and model.hidden == MODELS["deepseek-v3"].hidden
    assert load_model("mixtral-8x7b") is MODELS["mixtral-8x7b"]
    path.write_text(json.dumps({"base": "deepseek-v3", "layerz": 3}))
    with pytest.raises(ValueError, match="layerz"):
        load_model(path)
    with pytest.raises(ValueError, match="top_k"):
        replace(SMALL, top_k=17)
    with pytest.raises(ValueError, match="must be one of"):
        load_model("gpt-9")


# -- traces ---------------------------------------------------------------------------------------


def test_generated_trace_is_seeded_and_sums_to_the_pairs():
    a = generate_trace(20, num_layers=3, num_experts=32, num_groups=4, top_k=4, tokens=1000, seed=3)
    b = generate_trace(20, num_layers=3, num_experts=32, num_groups=4, top_k=4, tokens=1000, seed=3)
    assert a.shape == (20, 3, 32) and np.array_equal(a, b)
    assert np.all(a.sum(axis=-1) == 4000)
    assert np.all(a <= 1000)                    # one pair per token and expert at most
    assert not np.array_equal(a, generate_trace(20, num_layers=3, num_experts=32, num_groups=4,
                                                top_k=4, tokens=1000, seed=4))


def test_fit_recovers_the_dynamics_a_trace_was_generated_with():
    truth = Dynamics(sigma_drift=0.03, rho=0.0, sigma_step=0.1, burst_rate=0.02, burst_size=6.0,
                     level_band=0.3)
    counts = generate_trace(400, num_layers=4, num_experts=16, num_groups=4, top_k=2,
                            tokens=200_000, dynamics=truth, skew="moderate", seed=1)
    fit = fit_dynamics(counts)
    assert fit.sigma_step == pytest.approx(truth.sigma_step, rel=0.25)
    assert fit.burst_rate == pytest.approx(truth.burst_rate, rel=0.5)
    assert fit.sigma_drift == pytest.approx(truth.sigma_drift, rel=0.5)


def test_default_dynamics_come_from_both_shipped_traces():
    d = default_dynamics()
    assert "mixtral" in d.fitted_on and "qwen3_moe" in d.fitted_on
    assert d.sequences == 16 and 0 < d.sigma_step < 1 and 0 <= d.burst_rate < 0.5


def test_more_sequences_a_step_give_smoother_steps():
    def spread(sequences):
        counts = generate_trace(60, num_layers=2, num_experts=16, num_groups=4, top_k=2,
                                tokens=10**6, sequences=sequences, seed=0)
        shares = counts / counts.sum(axis=-1, keepdims=True)
        return np.median(np.abs(np.diff(np.log(shares), axis=0)))

    assert spread(16 * 16) < 0.4 * spread(16)
    with pytest.raises(ValueError, match="sequences"):
        generate_trace(5, sequences=-1)


def test_read_trace_takes_shipped_names_and_files(tmp_path):
    counts, what = read_trace("mixtral")
    assert counts.shape == (300, 4, 16) and "recorded" in what
    np.savez(tmp_path / "t.npz", counts=counts[:10])
    assert read_trace(str(tmp_path / "t.npz"))[0].shape == (10, 4, 16)
    np.save(tmp_path / "flat.npy", counts[0])
    with pytest.raises(ValueError, match=r"\[steps, layers, experts\]"):
        read_trace(str(tmp_path / "flat.npy"))
    with pytest.raises(ValueError, match="generated"):
        read_trace("loads.csv")


# -- the step model -------------------------------------------------------------------------------


def test_compute_is_the_slowest_device_and_rest_waits_for_the_slowest_kind():
    slow = replace(KIND, name="Y", flops=0.5e12)
    cluster = _cluster(["X", "Y"], [0, 0], {"X": KIND, "Y": slow})
    sm = StepModel(cluster, SMALL)
    loads = np.array([[[300.0, 212.0]]])                    # pairs on each device
    per_pair = SMALL.flops_per_pair
    assert sm.compute_seconds(loads)[0, 0] == pytest.approx(max(300 * per_pair / 1e12,
                                                                212 * per_pair / 0.5e12))
    assert sm.non_moe == pytest.approx(1e6 * 256 / 0.5e12)


def test_all_to_all_matches_a_hand_worked_two_node_case():
    # 4 devices, 2 per node; 256 tokens x 2 = 512 pairs from each device, 2048 in all.
    cluster = _cluster(["X"] * 4, [0, 0, 1, 1])
    sm = StepModel(cluster, SMALL)
    loads = np.array([[[800.0, 400.0, 448.0, 400.0]]])
    row = SMALL.row_bytes
    # device 0: sends (1200 - 800) / 4 = 100 pairs on its node and (2048 - 1200) / 4 = 212 off
    # it; receives 800 / 4 = 200 pairs from its node mate and 400 from the other node.
    device0 = max(100, 200) * row / 100e9 + max(212, 400) * row / 10e9
    device1 = max(200, 100) * row / 100e9 + max(212, 200) * row / 10e9
    device2 = max(100, 112) * row / 100e9 + max(300, 224) * row / 10e9
    device3 = max(112, 100) * row / 100e9 + max(300, 200) * row / 10e9
    expected = EXCHANGES * max(device0, device1, device2, device3)
    assert sm.all_to_all_seconds(loads)[0, 0] == pytest.approx(expected)


def test_migration_counts_the_copies_a_placement_needs_and_their_slowest_link():
    cluster = _cluster(["X"] * 4, [0, 0, 1, 1])
    sm = StepModel(cluster, SMALL)
    topology = cluster.topology(SMALL)
    rng = np.random.default_rng(0)
    old = mb.plan(rng.random((4, 16)) * 100, topology)
    new = mb.plan(rng.random((4, 16)) * 100, topology)
    seconds, nbytes, moves = sm.migration(old, new)
    assert moves == new.moves_from(old) and nbytes == moves * SMALL.bytes_per_move
    assert seconds.shape == (1,) and seconds[0] > 0
    assert sm.migration(new, new)[2] == 0


def test_one_copy_across_nodes_takes_the_network_links_time():
    model = replace(SMALL, num_layers=1, num_experts=4, top_k=1, num_groups=1)
    sm = StepModel(_cluster(["X"] * 4, [0, 0, 1, 1]), model)        # 2 slots per device
    dev = sm.topology.slot_device
    third = 1 / 3
    old = mb.Placement(np.array([[0, 1, 2, 3, 1, 2, 3, 1]]),
                       np.array([[1, third, 0.5, 0.5, third, 0.5, 0.5, third]]), dev, 4)
    # device 3 drops a replica of expert 1 for expert 0, held only on node 0
    new = mb.Placement(np.array([[0, 1, 2, 3, 1, 2, 3, 0]]),
                       np.array([[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]]), dev, 4)
    seconds, nbytes, moves = sm.migration(old, new)
    assert moves == 1 and nbytes == model.bytes_per_move
    assert seconds[0] == pytest.approx(model.bytes_per_move / 10e9)


def test_live_migration_is_exposed_only_beyond_the_steps_compute():
    sm = StepModel(_cluster(["X"] * 2, [0, 0]), SMALL)
    terms = {"expert_compute": np.full(4, 0.1), "all_to_all": np.full(4, 5.0),
             "non_moe": np.full(4, 0.05)}
    # the window is the stage's expert compute and rest, 4 x 0.15 s (not the all-to-all)
    assert sm.exposed_migration(np.array([0.5]), terms, "live") == 0.0
    assert sm.exposed_migration(np.array([1.0]), terms, "live") == pytest.approx(0.4)
    assert sm.exposed_migration(np.array([1.0]), terms, "blocking") == 1.0
    assert sm.exposed_migration(np.array([1.0]), terms, "free") == 0.0
    with pytest.raises(ValueError, match="live"):
        sm.exposed_migration(np.array([1.0]), terms, "later")


def test_layers_move_per_pipeline_stage_in_parallel():
    model = replace(SMALL, layers_per_device=2)
    sm = StepModel(_cluster(["X"] * 4, [0, 0, 1, 1]), model)
    assert sm.stage_of_layer(4).tolist() == [0, 0, 1, 1]
    topology = sm.topology
    rng = np.random.default_rng(1)
    old, new = (mb.plan(rng.random((4, 16)) * 100, topology) for _ in range(2))
    seconds, _, moves = sm.migration(old, new)
    assert seconds.shape == (2,) and moves == new.moves_from(old)


# -- the per-step re-split kernel -----------------------------------------------------------------


def test_resplit_kernel_compiled_equals_reference_and_keeps_every_token():
    from moebalance.lab.bench.per_step import best_resplit

    rng = np.random.default_rng(5)
    topology = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.25], slots=[6, 6, 6, 6])
    placement = mb.plan(rng.gamma(0.7, 100.0, size=(1, 16)), topology)
    counts = rng.gamma(0.7, 100.0, size=(30, 16))
    args = (devices_of(topology), placement.phy2log[0], placement.share[0], MAX_SWEEPS)
    fast = _jit.kernels("numba").resplit_device_loads(counts, *args)
    slow = _jit.kernels("numpy").resplit_device_loads(counts, *args)
    np.testing.assert_allclose(fast, slow, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(fast.sum(axis=1), counts.sum(axis=1))
    for t in range(counts.shape[0]):
        static = _jit.kernels("numpy").device_loads(counts[t], devices_of(topology),
                                                    placement.phy2log[0], placement.share[0])
        best, _ = best_resplit(counts[t], placement.phy2log[0], topology)
        hottest = (fast[t] / topology.speed).max()
        assert best - 1e-6 <= hottest <= (static / topology.speed).max() + 1e-6


# -- policies and the loop ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_run():
    cluster = _cluster(["X"] * 8, [g // 4 for g in range(8)])
    counts = generate_trace(70, num_layers=4, num_experts=16, num_groups=4, top_k=2,
                            tokens=2048, seed=2)
    sm = StepModel(cluster, SMALL)
    policies = default_policies(10, 10, move_price(sm, 10, 4))
    return simulate(counts, cluster, SMALL, policies, warmup=10), counts


def test_every_policy_runs_and_its_terms_add_up(small_run):
    sim, counts = small_run
    assert sim.runs[0].name == "static uniform" and sim.runs[-1].name == "oracle (bound)"
    for run in sim.runs:
        assert run.step_seconds.shape == (60,)
        np.testing.assert_allclose(sum(run.terms.values()), run.step_seconds)
        assert np.all(run.imbalance >= 1 - 1e-9)
        assert run.layer_loads.sum() == pytest.approx(
            scale_trace(counts, SMALL, 8)[10:, sim.shown_layer].sum(axis=-1).mean())
    static, eplb, periodic, resplit, oracle = sim.runs
    assert static.replans == [] and oracle.replans == []
    assert [r["step"] for r in eplb.replans] == [20, 30, 40, 50, 60]
    assert eplb.terms["migration"].sum() > 0 and periodic.terms["migration"].sum() >= 0
    assert resplit.imbalance.mean() <= periodic.imbalance.mean() + 1e-9
    assert np.all(oracle.imbalance == pytest.approx(1.0))
    assert all(oracle.step_seconds.mean() <= r.step_seconds.mean() + 1e-12 for r in sim.runs)
    summary = sim.summaries()[2]
    assert summary["replans"] == 5 and summary["tokens_per_s"] == pytest.approx(
        8 * 256 / periodic.step_seconds.mean())


def test_move_budget_caps_moves_per_replan():
    cluster = _cluster(["X"] * 8, [0] * 8)
    counts = generate_trace(60, num_layers=4, num_experts=16, num_groups=4, top_k=2,
                            tokens=2048, skew="heavy", seed=4)
    sim = simulate(counts, cluster, SMALL, [MoebalancePeriodic(10, max_moves=3)], warmup=10)
    assert sim.runs[0].replans and all(r["moves"] <= 3 for r in sim.runs[0].replans)


def test_policies_see_only_the_past_and_keep_their_placement_between_replans():
    seen = []

    class Spy(EPLBPeriodic):
        def step(self, t, history_TLE, current):
            seen.append((t, history_TLE.shape[0]))
            return super().step(t, history_TLE, current)

    cluster = _cluster(["X"] * 4, [0] * 4)
    counts = generate_trace(25, num_layers=4, num_experts=16, num_groups=4, top_k=2, tokens=512)
    simulate(counts, cluster, SMALL, [Spy(5), StaticUniform(), Oracle()], warmup=5)
    assert all(t == n for t, n in seen) and seen[0][0] == 6


@pytest.mark.parametrize("kwargs, message", [
    (dict(every=0), "every"), (dict(every=5, window=0), "window"),
])
def test_bad_policy_settings_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoebalancePeriodic(**kwargs)
    with pytest.raises(ValueError, match="max_moves"):
        MoebalancePeriodic(5, max_moves=-1)


def test_simulate_checks_the_trace_against_the_model():
    cluster = _cluster(["X"] * 4, [0] * 4)
    counts = np.ones((20, 3, 16))
    with pytest.raises(ValueError, match="with_trace_shape"):
        simulate(counts, cluster, SMALL, [Oracle()], warmup=5)
    with pytest.raises(ValueError, match="warmup"):
        simulate(np.ones((20, 4, 16)), cluster, SMALL, [Oracle()], warmup=20)


# -- the command ----------------------------------------------------------------------------------


def test_simulate_command_writes_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = cli.main(["simulate", "--model", "mixtral-8x7b", "--cluster", "h100-8,h100-a100-64",
                   "--steps", "30", "--every", "10", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "EPLB every 10" in text and "oracle (bound)" in text and "tokens/s" in text
    data = json.loads((out / "results.json").read_text())
    assert [r["cluster"]["name"] for r in data["results"]] == ["h100-8", "h100-a100-64"]
    first = data["results"][0]
    assert len(first["summaries"]) == 5 and len(first["runs"][0]["step_seconds"]) == 30
    assert (out / "simulate-h100-8.png").stat().st_size > 10_000
    assert "## h100-a100-64" in (out / "summary.md").read_text()


def test_simulate_command_replays_a_recorded_trace(tmp_path, capsys):
    rc = cli.main(["simulate", "--trace", "qwen3_moe", "--model", "mixtral-8x7b", "--cluster",
                   "h100-64", "--every", "50", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())["results"][0]
    assert result["steps"] == 250 and "recorded" in result["trace"]
    # the shape and the router's top-k come from the trace, not from --model
    assert (result["model"]["num_experts"], result["model"]["top_k"]) == (16, 4)
    assert "top-4 as recorded" in result["trace"]


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "h100-7"], "--cluster: cluster must be a preset name"),
    (["--cluster", "h100-8"], "do not fit"),
    (["--trace", "nowhere.npz"], "--trace: cannot read trace"),
    (["--trace", "mixtral", "--every", "400"], "holds 300 steps"),
    (["--trace", "mixtral", "--every", "200"], "too few for a re-plan every 200 steps"),
    (["--steps", "50", "--every", "100"], "too few for a re-plan every 100 steps"),
    (["--cluster", "homogeneous-320"], "is a slot layout of 'moebalance plan'"),
    (["--model", "gpt-9"], "--model: model must be one of"),
])
def test_simulate_command_errors_are_one_line(argv, message, tmp_path, capsys):
    assert cli.main(["simulate", *argv, "--no-plots", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moebalance simulate: error:") and message in err
    assert len(err.splitlines()) == 1
