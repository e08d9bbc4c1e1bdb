"""Built-in workloads: seeded synthetic loads, drift, shipped traces and the named clusters."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moebalance import Topology
from moebalance.lab import workloads
from moebalance.lab.workloads import (
    CLUSTERS,
    SKEWS,
    Skew,
    cluster,
    drift,
    synthetic_loads,
    trace_clusters,
    trace_loads,
    trace_names,
)

SMALL = dict(num_layers=6, num_experts=64, num_groups=8, top_k=4, tokens=2048)


# -- synthetic loads ------------------------------------------------------------------------------

def test_synthetic_loads_default_is_deepseek_v3_sized():
    w = synthetic_loads()
    assert w.shape == (58, 256) and w.dtype == np.float64
    np.testing.assert_array_equal(w.sum(axis=1), np.full(58, 8192.0 * 8))


@pytest.mark.parametrize("skew", sorted(SKEWS))
def test_synthetic_loads_same_seed_same_loads(skew):
    np.testing.assert_array_equal(synthetic_loads(skew, 7, **SMALL),
                                  synthetic_loads(skew, 7, **SMALL))


def test_synthetic_loads_different_seeds_differ():
    assert not np.array_equal(synthetic_loads("moderate", 1, **SMALL),
                              synthetic_loads("moderate", 2, **SMALL))


@pytest.mark.parametrize("skew", sorted(SKEWS))
def test_synthetic_loads_are_whole_counts_summing_to_routed_pairs(skew):
    w = synthetic_loads(skew, 3, **SMALL)
    assert w.shape == (6, 64)
    assert np.all(w >= 0) and np.array_equal(w, np.round(w))
    np.testing.assert_array_equal(w.sum(axis=1), np.full(6, 2048.0 * 4))


def test_synthetic_loads_no_expert_gets_more_pairs_than_tokens_on_average():
    # a token picks top_k distinct experts, so an expert's expected share is at most 1/top_k
    w = synthetic_loads(Skew(zipf_exponent=2.0, group_sigma=0.0, noise_sigma=0.0), 0,
                        num_layers=20, num_experts=64, num_groups=1, top_k=8, tokens=100_000)
    assert w.max() <= 100_000 * 1.02  # multinomial noise around the cap


def test_heavy_skew_is_more_skewed_than_moderate():
    ratio = {s: (w.max(axis=1) / w.mean(axis=1)).mean()
             for s, w in ((s, synthetic_loads(s, 0)) for s in ("moderate", "heavy"))}
    assert ratio["heavy"] > 1.5 * ratio["moderate"] > 1.5


def test_hot_groups_make_group_totals_vary_more_than_independent_experts_would():
    # group heat sigma 0.25 (heavy) vs none: the spread of group totals must grow
    E, groups = 256, 8
    kw = dict(num_layers=58, num_experts=E, num_groups=groups, top_k=8, tokens=8192)
    with_heat = synthetic_loads(SKEWS["heavy"], 0, **kw)
    no_heat = synthetic_loads(Skew(SKEWS["heavy"].zipf_exponent, 0.0), 0, **kw)

    def group_spread(w):
        g = w.reshape(w.shape[0], groups, E // groups).sum(axis=2)
        return (g.std(axis=1) / g.mean(axis=1)).mean()

    assert group_spread(with_heat) > 1.5 * group_spread(no_heat)


def test_hot_experts_differ_between_layers():
    w = synthetic_loads("heavy", 0)
    assert np.unique(w.argmax(axis=1)).size > 20


@pytest.mark.parametrize("kwargs, match", [
    (dict(skew="extreme"), "skew"),
    (dict(skew=1.0), "skew"),
    (dict(seed=-1), "seed"),
    (dict(num_layers=0), "num_layers"),
    (dict(num_experts=60, num_groups=8), "num_groups"),
    (dict(num_experts=8, num_groups=1, top_k=9), "top_k"),
    (dict(tokens=2.5), "tokens"),
])
def test_synthetic_loads_rejects_bad_arguments_naming_them(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        synthetic_loads(**kwargs)


# -- drift ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rel", [0.05, 0.2])
def test_drift_keeps_layer_totals(rel):
    w = synthetic_loads("moderate", 0, **SMALL)
    np.testing.assert_allclose(drift(w, rel, seed=1).sum(axis=1), w.sum(axis=1), rtol=1e-12)


@pytest.mark.parametrize("rel", [0.05, 0.2])
def test_drift_changes_loads_by_about_rel(rel):
    w = synthetic_loads("moderate", 0)
    change = drift(w, rel, seed=1) / w - 1.0
    assert 0.85 * rel < np.sqrt(np.mean(change[np.isfinite(change)] ** 2)) < 1.15 * rel


def test_drift_is_deterministic_by_seed_and_leaves_input_alone():
    w = synthetic_loads("moderate", 0, **SMALL)
    before = w.copy()
    np.testing.assert_array_equal(drift(w, 0.2, seed=5), drift(w, 0.2, seed=5))
    assert not np.array_equal(drift(w, 0.2, seed=5), drift(w, 0.2, seed=6))
    np.testing.assert_array_equal(w, before)


def test_drift_zero_returns_the_same_loads():
    w = synthetic_loads("moderate", 0, **SMALL)
    np.testing.assert_allclose(drift(w, 0.0, seed=3), w, rtol=1e-12)


def test_drift_keeps_empty_layers_empty():
    w = np.zeros((2, 8))
    w[1] = np.arange(8)
    out = drift(w, 0.2, seed=0)
    np.testing.assert_array_equal(out[0], 0.0)
    assert out[1, 0] == 0.0 and out[1].sum() == pytest.approx(28.0)


@pytest.mark.parametrize("rel", [-0.1, float("nan"), 3.0])
def test_drift_rejects_bad_rel(rel):
    with pytest.raises(ValueError, match="rel"):
        drift(np.ones((2, 4)), rel)


def test_drift_rejects_negative_loads():
    with pytest.raises(ValueError, match="loads"):
        drift(-np.ones((2, 4)), 0.05)


# -- traces ---------------------------------------------------------------------------------------

def test_trace_loads_missing_trace_raises_file_not_found_naming_it():
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        trace_loads("no-such-model")


def test_trace_loads_reads_counts_and_meta(tmp_path, monkeypatch):
    counts = np.random.default_rng(0).integers(0, 50, size=(5, 3, 8))
    np.savez(tmp_path / "tiny_trace.npz", counts=counts,
             meta=np.array(json.dumps({"model": "tiny", "top_k": 2})))
    monkeypatch.setattr(workloads, "trace_path", lambda name: tmp_path / f"{name}_trace.npz")
    got, meta = trace_loads("tiny")
    assert got.dtype == np.float64 and got.shape == (5, 3, 8)
    np.testing.assert_array_equal(got, counts)
    assert meta == {"model": "tiny", "top_k": 2}


def test_trace_loads_rejects_a_file_without_counts(tmp_path, monkeypatch):
    np.savez(tmp_path / "bad_trace.npz", other=np.zeros(3))
    monkeypatch.setattr(workloads, "trace_path", lambda name: tmp_path / f"{name}_trace.npz")
    with pytest.raises(ValueError, match="counts"):
        trace_loads("bad")


def test_two_model_families_ship_a_trace():
    assert {"mixtral", "qwen3_moe"} <= set(trace_names())


@pytest.mark.parametrize("name, model, experts_field", [
    ("mixtral", "MixtralForCausalLM", "num_local_experts"),
    ("qwen3_moe", "Qwen3MoeForCausalLM", "num_experts"),
])
def test_shipped_trace_counts_every_routed_token_once_per_step(name, model, experts_field):
    counts, meta = trace_loads(name)
    config = meta["config"]
    assert meta["model"].startswith(model)
    assert counts.shape == (meta["steps"], config["num_hidden_layers"], config[experts_field])
    # every token of a step is routed to top-k experts in every layer
    np.testing.assert_array_equal(counts.sum(axis=2),
                                  meta["tokens_per_step"] * config["num_experts_per_tok"])
    assert config["router_aux_loss_coef"] == 0.0


def test_qwen3_moe_trace_is_a_different_routing_from_mixtral():
    mixtral, mixtral_meta = trace_loads("mixtral")
    qwen, qwen_meta = trace_loads("qwen3_moe")
    assert qwen_meta["family"] == "qwen3_moe" and qwen_meta["config"]["norm_topk_prob"] is True
    top_k = "num_experts_per_tok"
    assert qwen_meta["config"][top_k] != mixtral_meta["config"][top_k]
    assert mixtral.shape[1:] == qwen.shape[1:] and not np.array_equal(mixtral, qwen)


def test_trace_name_must_be_a_plain_name():
    with pytest.raises(ValueError, match="name"):
        trace_loads("../etc/passwd")


# -- clusters -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, devices, slots, nodes", [
    ("homogeneous-320", 64, 320, 8),
    ("homogeneous-288", 32, 288, 4),
    ("uneven-288", 64, 288, 8),
    ("heterogeneous", 64, 320, 8),
])
def test_named_clusters_have_their_stated_sizes(name, devices, slots, nodes):
    topo = cluster(name).topology()
    assert isinstance(topo, Topology)
    assert (topo.num_devices, topo.num_slots, topo.num_nodes) == (devices, slots, nodes)


def test_homogeneous_clusters_are_homogeneous_and_others_are_not():
    assert CLUSTERS["homogeneous-320"].topology().is_homogeneous
    assert CLUSTERS["homogeneous-288"].topology().is_homogeneous
    assert not CLUSTERS["uneven-288"].topology().is_homogeneous
    assert not CLUSTERS["heterogeneous"].topology().is_homogeneous


def test_uneven_cluster_alternates_five_and_four_slots():
    topo = cluster("uneven-288").topology()
    np.testing.assert_array_equal(topo.slots, np.tile([5, 4], 32))
    assert np.all(topo.speed == 1.0)


def test_heterogeneous_cluster_has_fast_and_slow_nodes():
    topo = cluster("heterogeneous").topology()
    fast = topo.node < 4
    assert np.all(topo.speed[fast] == 1.0) and np.all(topo.slots[fast] == 4)
    assert np.all(topo.speed[~fast] == 0.5) and np.all(topo.slots[~fast] == 6)


def test_clusters_are_frozen():
    with pytest.raises(AttributeError):
        cluster("heterogeneous").name = "other"


def test_unknown_cluster_name_lists_the_choices():
    with pytest.raises(ValueError, match="homogeneous-320"):
        cluster("nope")


@pytest.mark.parametrize("experts", [8, 64, 256])
def test_trace_clusters_fit_the_experts_with_room_to_replicate(experts):
    homo, hetero = trace_clusters(experts)
    for c in (homo, hetero):
        topo = c.topology()
        assert topo.num_slots >= 1.25 * experts and topo.slots.max() <= experts
    assert homo.topology().is_homogeneous and not hetero.topology().is_homogeneous
