"""moebalance bench simcheck: the trace router routes exactly the trace, the calibration file is a
cluster file, and the check runs end to end on 4 gloo ranks."""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np
import pytest
import torch
from _launches import Launch

from moebalance.lab.bench.simcheck import (
    CoreShare,
    TraceRouter,
    calibration_cluster,
    load_calibration,
    pair_counts,
    steady_allocator,
    trace_topk_ids,
)
from moebalance.lab.sim.cluster import load_cluster
from moebalance.lab.sim.stepmodel import StepModel


def test_core_share_holds_forward_and_backward_windows_and_needs_an_input_gradient():
    from moebalance.nn.moe import SlotExperts

    torch.manual_seed(0)
    experts = SlotExperts(2, 32, 64)
    share = CoreShare(0.5)
    share.attach(experts)
    windows = []
    share.close = lambda: windows.append("close")
    share.open = lambda: windows.append("open")
    x = torch.randn(16, 32, requires_grad=True)
    experts(x, [10, 6]).sum().backward()
    # forward opens and closes; the output's gradient opens the backward, the input's closes it
    assert windows == ["open", "close", "open", "close"]
    with torch.no_grad():
        experts(torch.randn(16, 32), [10, 6])              # no backward, no window left open
    assert windows[4:] == ["open", "close"]
    # an input without a gradient would leave the backward window open to the next forward
    with pytest.raises(ValueError, match="input that requires grad"):
        experts(torch.randn(16, 32), [10, 6])


def test_core_share_sleeps_to_its_share_of_the_cpu_time():
    share = CoreShare(0.25)
    share.open()
    spent = time.thread_time()
    while time.thread_time() - spent < 0.02:           # 20 ms of this thread's CPU
        pass
    share.close()
    # a window alone on a core lasts cpu / share: about 60 ms more beyond the 20 computed
    assert 0.045 <= share.slept <= 0.2


@pytest.mark.parametrize("seed", range(5))
def test_trace_router_routes_exactly_the_scaled_counts_with_distinct_experts(seed):
    rng = np.random.default_rng(seed)
    T, E, K, N, G = 3, 16, 2, 24, 4
    counts_TE = rng.integers(0, 500, (T, E)).astype(np.float64)
    counts_TE[:, 0] *= 20                                        # one expert far above the cap
    routers = [TraceRouter(32, counts_TE, K, N, rank=g, world_size=G, seed=seed) for g in range(G)]
    for t in range(T):
        ids = []
        for router in routers:
            router.step = t
            _, weights, topk = router(torch.randn(N, 32))
            assert topk.shape == (N, K) and topk.dtype == torch.int64
            assert torch.allclose(weights.sum(dim=-1), torch.ones(N))
            ids.append(topk.numpy())
        ids = np.stack(ids)                                          # [G, N, K]
        assert all(len(set(row)) == K for row in ids.reshape(-1, K).tolist())
        expected = pair_counts(counts_TE[t], G * N * K, G * N)
        assert expected.sum() == G * N * K and expected.max() <= G * N
        assert np.array_equal(np.bincount(ids.ravel(), minlength=E), expected)
        per_rank = np.stack([np.bincount(ids[g].ravel(), minlength=E) for g in range(G)])
        assert per_rank.max(axis=0).tolist() <= np.ceil(expected / G).tolist()


def test_pair_counts_follow_the_shares_and_reject_impossible_caps():
    assert pair_counts(np.array([1.0, 1.0, 2.0]), 8, 8).tolist() == [2, 2, 4]
    assert pair_counts(np.zeros(4), 6, 6).sum() == 6
    with pytest.raises(ValueError, match="cannot go to"):
        pair_counts(np.ones(2), 10, 4)
    with pytest.raises(ValueError, match="counts_E"):
        pair_counts(np.array([1.0, -1.0]), 2, 2)


def test_trace_ids_give_every_rank_its_tokens_times_k_pairs():
    ids = trace_topk_ids(np.array([5.0, 0, 0, 1, 1, 1]), 6, 3, 2, np.random.default_rng(0))
    assert ids.shape == (2, 6, 3)
    assert all(len(set(row)) == 3 for row in ids.reshape(-1, 3).tolist())


def test_trace_router_gate_learns_and_bad_input_names_the_argument():
    router = TraceRouter(8, np.ones((2, 4)), 2, 5)
    _, weights, _ = router(torch.randn(5, 8))
    (weights * torch.randn(5, 2)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="tokens"):
        router(torch.randn(4, 8))
    with pytest.raises(ValueError, match="top_k"):
        TraceRouter(8, np.ones((2, 4)), 5, 5)
    with pytest.raises(ValueError, match="rank"):
        TraceRouter(8, np.ones((2, 4)), 2, 5, rank=3, world_size=2)


def test_steady_allocator_reuses_freed_blocks_without_faulting_them_back():
    if not steady_allocator():
        pytest.skip("mallopt needs glibc")

    def forward_like() -> None:
        blocks = [np.ones(3 << 17) for _ in range(12)]          # 12 temporaries of 3 MiB
        assert all(b[-1] == 1.0 for b in blocks)

    forward_like()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        forward_like()
    # glibc's defaults trim the freed heap top and fault it back: about 46,000 faults here
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 1000


def test_calibration_file_round_trips_through_load_cluster(tmp_path):
    figures = {"flops": 4.2e10, "bandwidth": 1.5e9, "latency": 2e-3,
               "non_moe_flops_per_token": 3e6}
    cfg = {"layers": 4, "experts": 16, "top_k": 2, "hidden": 64, "ffn": 128, "tokens": 32,
           "ranks": 4, "cores": 2, "pace": True}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibration_cluster(figures, cfg)))
    cluster = load_cluster(path)
    assert cluster.num_devices == 4 and set(cluster.nodes) == {0}
    kind = cluster.catalogue[cluster.kinds[0]]
    assert (kind.expert_flops, kind.intra_bandwidth, kind.intra_latency) == (4.2e10, 1.5e9, 2e-3)
    again, model, _ = load_calibration(path)
    assert again == cluster
    assert (model.hidden, model.ffn, model.tokens_per_device, model.non_moe_flops_per_token) == \
        (64, 128, 32, 3e6)
    assert cluster.slots(model).tolist() == [5, 5, 5, 5]
    step = StepModel(cluster, model)
    assert step.non_moe == pytest.approx(3e6 * 32 / 4.2e10)


def test_calibration_file_without_a_model_is_refused(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"nodes": [{"kind": "H100", "devices": 4}]}))
    with pytest.raises(ValueError, match="'model'"):
        load_calibration(path)


LAUNCHES = {"test_simcheck_runs_end_to_end_on_four_ranks": [Launch(
    "bench simcheck", [sys.executable, "-m", "moebalance", "bench", "simcheck", "--quick",
                       "--hidden", "16", "--ffn", "32", "--tokens", "16", "--warmup", "2",
                       "--steps", "2", "--every", "2", "--out", "{out}"], seconds=10)]}


def test_simcheck_runs_end_to_end_on_four_ranks(launches):
    rc, out, err = launches.result("bench simcheck")
    folder = launches.folder("bench simcheck")
    assert rc == 0, err[-3000:]
    assert "same ranking" in out
    assert "moebalance bench simcheck [" in err and "calibrating" in err
    result = json.loads((folder / "results.json").read_text())
    assert len(result["policies"]) == 4
    for row in result["policies"]:
        assert len(row["measured_step_s"]) == 2 and row["modelled_mean_step_s"] > 0
        assert row["measured_imbalance"] == pytest.approx(row["modelled_imbalance"], rel=0.05)
    load_calibration(folder / "calibration.json")
    assert (folder / "summary.md").is_file()


def test_simcheck_rejects_a_calibration_of_another_shape(tmp_path, capsys):
    figures = {"flops": 4e10, "bandwidth": 1e9, "latency": 1e-3, "non_moe_flops_per_token": 0.0}
    cfg = {"layers": 4, "experts": 16, "top_k": 2, "hidden": 64, "ffn": 128, "tokens": 32,
           "ranks": 4, "cores": 2, "pace": True}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibration_cluster(figures, cfg)))
    from moebalance.cli import main as cli

    # in this process: the check runs before any rank is spawned
    assert cli.main(["bench", "simcheck", "--calibration", str(path), "--hidden", "32"]) == 2
    assert "--hidden 32" in capsys.readouterr().err
