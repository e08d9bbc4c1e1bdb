"""Measured device speeds: Topology.measure agrees on every rank and round-trips; the per-step
tracker smooths, ignores jitter when told to, and moves load away from a straggler.

The distributed cases run in ONE spawn of 4 gloo ranks (see ``_dist.py``). No case asserts a
timing ratio: the machine is shared, so the tests check decisions and agreement, and the figures
live in ``moebalance bench straggler``.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import case_id, shared_spawn
from torch.testing import assert_close

import moebalance as mb
from moebalance.nn.moe import ExpertParallelMoE
from moebalance.speeds import BACKWARD_WORK, ExpertTimer, SpeedTracker

# -- the tracker, on one process ----------------------------------------------------------------


def figures(work_GT, seconds_GT) -> np.ndarray:
    return np.stack([np.asarray(work_GT, float), np.asarray(seconds_GT, float)], axis=-1)


def test_tracker_smooths_each_rank_exponentially():
    tracker = SpeedTracker(every=3, smoothing=0.5)
    # rank 0 pushes 100 rows/s every step, rank 1 100 then 50 then 50
    tracker.update(figures([[100, 100, 100], [100, 100, 100]], [[1, 1, 1], [1, 2, 2]]))
    assert_close(tracker.speed, np.array([100.0, 100 * 0.25 + 50 * 0.75]))
    assert_close(tracker.relative(), tracker.speed / 100.0)
    assert len(tracker.history) == 3
    assert_close(tracker.expert_s, (1 + 2 + 2) / 3)


def _timed_steps(tracker, steps):
    x = torch.randn(64, 32)
    for _ in range(steps):
        tracker.timer.end(tracker.timer.begin(x) @ torch.randn(32, 32))
        tracker.step()


@pytest.mark.parametrize("warmup,kept", [(0, 3), (1, 2), (2, 1)])
def test_tracker_leaves_out_the_first_steps_of_each_process(warmup, kept):
    # A first step allocates and faults memory in, unevenly across ranks: its time is not speed.
    tracker = SpeedTracker(every=3, smoothing=1.0, warmup=warmup)
    _timed_steps(tracker, 3)
    assert len(tracker.history) == kept and tracker.steps == 3
    # A resumed process warms up again (the state keeps the last ``window`` = 1 speeds).
    resumed = SpeedTracker(every=3, smoothing=1.0, warmup=warmup)
    resumed.load_state_dict(tracker.state_dict())
    _timed_steps(resumed, 3)
    assert resumed.steps == 6 and len(resumed.history) == 1 + kept


def test_tracker_keeps_a_rank_speed_through_untimed_steps():
    tracker = SpeedTracker(smoothing=1.0)
    tracker.update(figures([[0, 10, 10], [10, 10, 30]], [[0, 1, 1], [1, 1, 1]]))
    # step 0 lacks rank 0: the average starts at step 1
    assert_close(tracker.speed, np.array([10.0, 30.0]))
    assert len(tracker.history) == 2
    tracker.update(figures([[0], [5]], [[0], [1]]))     # rank 0 untimed: it keeps its speed
    assert_close(tracker.speed, np.array([10.0, 5.0]))


def test_noise_control_ignores_jitter_below_min_change():
    tracker = SpeedTracker(smoothing=1.0, min_change=0.2, window=1)
    rng = np.random.default_rng(0)
    seconds = 1 + 0.05 * rng.standard_normal((4, 10))
    tracker.update(figures(np.ones((4, 10)), seconds))
    assert not tracker.moved(np.ones(4))
    tracker.update(figures(np.ones((4, 1)), [[1], [1], [1], [2]]))
    assert tracker.moved(np.ones(4))


def test_noise_control_window_needs_a_lasting_change():
    tracker = SpeedTracker(smoothing=1.0, min_change=0.2, window=3)
    slow = [[1, 1, 1]] * 3 + [[1, 2, 1]]          # one slow step of rank 3
    tracker.update(figures(np.ones((4, 3)), slow))
    assert not tracker.moved(np.ones(4))
    tracker.update(figures(np.ones((4, 3)), [[1, 1, 1]] * 3 + [[2, 2, 2]]))
    assert tracker.moved(np.ones(4))


def test_one_slow_step_in_the_window_does_not_set_the_planned_speeds():
    # rank 1 halves its speed at step 10; rank 0 hiccups once (0.7 of its speed) at step 13
    tracker = SpeedTracker(smoothing=0.3, min_change=0.15, window=3)
    seconds = [[1.0] * 13 + [1 / 0.7, 1.0], [1.0] * 10 + [2.0] * 5]
    tracker.update(figures(np.ones((2, 15)), seconds))
    assert_close(tracker.planning_speeds(), np.array([1.0, 0.5]))


def test_a_replan_after_a_lasting_change_is_for_the_new_speeds_not_the_lagging_average():
    # rank 1 halves its speed at step 10; the window of 3 steps confirms it by step 14
    tracker = SpeedTracker(smoothing=0.3, min_change=0.15, window=3)
    seconds = [[1.0] * 15, [1.0] * 10 + [2.0] * 5]
    tracker.update(figures(np.ones((2, 15)), seconds))
    assert tracker.moved(np.ones(2))
    assert tracker.relative()[1] > 0.55            # the smoothed speed is still on its way
    assert_close(tracker.planning_speeds(), np.array([1.0, 0.5]))
    # no confirmation window: the smoothed speeds are what a re-plan uses
    alone = SpeedTracker(smoothing=0.3)
    alone.update(figures(np.ones((2, 15)), seconds))
    assert_close(alone.planning_speeds(), alone.relative())


def test_without_noise_control_any_change_counts():
    tracker = SpeedTracker(smoothing=1.0)
    tracker.update(figures(np.ones((2, 1)), [[1.0], [1.0]]))
    assert not tracker.moved(np.ones(2))
    tracker.update(figures(np.ones((2, 1)), [[1.0], [1.01]]))
    assert tracker.moved(np.ones(2))


def test_tracker_rejects_bad_settings():
    with pytest.raises(ValueError, match="smoothing"):
        SpeedTracker(smoothing=0)
    with pytest.raises(ValueError, match="min_change"):
        SpeedTracker(min_change=-0.1)
    with pytest.raises(ValueError, match="window"):
        SpeedTracker(window=0)
    with pytest.raises(ValueError, match="warmup must be a number of steps >= 0"):
        SpeedTracker(warmup=-1)
    with pytest.raises(ValueError, match="move_price_s"):
        SpeedTracker(move_price_s=-1.0)
    with pytest.raises(ValueError, match="no speeds measured"):
        SpeedTracker().relative()
    with pytest.raises(TypeError, match="SpeedTracker"):
        mb.Rebalancer(_layer(), mb.Topology.uniform(1, 4), every=None, speeds="fast")


def _layer():
    placement = mb.plan(np.ones((1, 4)), mb.Topology.uniform(1, 4))
    return ExpertParallelMoE(16, 32, 4, 2, placement, seed=0)


def test_expert_timer_counts_forward_and_backward_rows():
    moe = _layer()
    timer = ExpertTimer()
    moe.expert_timer = timer
    x = torch.randn(10, 16)
    reference = _layer()
    assert_close(moe(x), reference(x))          # timing changes nothing
    moe(x.requires_grad_()).sum().backward()
    work, seconds = timer.collect()
    rows = 10 * 2                                # top-2: every token reaches two slots
    assert work == rows * 2 + rows * BACKWARD_WORK  # two forwards, one backward
    assert seconds > 0
    assert timer.collect() == (0.0, 0.0)
    moe(x.detach()).sum().backward()             # no input gradient: the forward alone
    assert timer.collect()[0] == rows


def test_topology_save_load_round_trip(tmp_path):
    topo = mb.Topology.from_arrays([1.0, 0.5, 0.75], [3, 4, 2], [0, 0, 1],
                                   speed_spread=[0.01, 0.02, 0.0])
    topo.save(tmp_path / "t.json")
    back = mb.Topology.load(tmp_path / "t.json")
    assert back == topo
    np.testing.assert_array_equal(back.speed_spread, topo.speed_spread)   # read-only arrays
    plain = mb.Topology.uniform(2, 3)
    plain.save(tmp_path / "p.json")
    assert mb.Topology.load(tmp_path / "p.json").speed_spread is None
    (tmp_path / "bad.json").write_text('{"speed": [1.0]}')
    with pytest.raises(ValueError, match="not a saved moebalance Topology"):
        mb.Topology.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="speed_spread"):
        mb.Topology.from_arrays([1.0], [1], speed_spread=[-1.0])


def test_measure_one_process_caps_slots_at_the_experts():
    topo = mb.Topology.measure(hidden_size=16, ffn_hidden_size=32, num_experts=6, tokens=64,
                               repeats=3)
    assert topo.num_devices == 1 and topo.slots.tolist() == [6] and topo.speed.tolist() == [1.0]
    assert topo.speed_spread is not None
    small = mb.Topology.measure(hidden_size=16, ffn_hidden_size=32, num_experts=6, tokens=64,
                                repeats=3, memory=3 * 16 * 32 * 16 * 2)   # two fp32 Adam slots
    assert small.slots.tolist() == [2]
    with pytest.raises(ValueError, match="slots= or num_experts="):
        mb.Topology.measure(hidden_size=16, ffn_hidden_size=32)
    with pytest.raises(ValueError, match="hold no slot"):
        mb.Topology.measure(hidden_size=16, ffn_hidden_size=32, num_experts=4, memory=10)
    with pytest.raises(ValueError, match="hidden_size"):
        mb.Topology.measure(num_experts=4)


# -- on 4 ranks ---------------------------------------------------------------------------------


def measure_agrees_on_every_rank():
    topo = mb.Topology.measure(hidden_size=32, ffn_hidden_size=64, slots=[2, 3, 2, 3],
                               tokens=128, repeats=3)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, topo.to_dict())
    assert all(d == everyone[0] for d in everyone)
    assert topo.slots.tolist() == [2, 3, 2, 3]
    assert topo.node.tolist() == [0, 0, 0, 0]      # one host
    assert topo.speed.max() == 1.0 and np.all(topo.speed > 0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "topology.json")
        topo.save(path)
        assert mb.Topology.load(path) == topo


def measure_error_raises_on_every_rank():
    tokens = 0 if dist.get_rank() == 2 else 64
    with pytest.raises(ValueError, match="rank 2: tokens must be an integer >= 1"):
        mb.Topology.measure(hidden_size=16, ffn_hidden_size=32, slots=2, tokens=tokens)
    # the group still works afterwards
    topo = mb.Topology.measure(hidden_size=16, ffn_hidden_size=32, slots=2, tokens=64, repeats=2)
    assert topo.num_devices == 4


STRAGGLER = dict(hidden=64, ffn=256, tokens=128, experts=8, slots=3, layers=2, steps=20,
                 slow_at=4, slow=0.1, every=4, window=2, min_change=0.3, seed=3, share=None,
                 float64=True)


def straggler_replans_away_from_the_slow_rank():
    from moebalance.lab.bench.straggler import straggler_pair

    # the two runs train side by side, as the benchmark trains them
    runs = straggler_pair(STRAGGLER)
    tracked, fixed = runs["speed tracking"], runs["fixed topology"]
    assert len(tracked["step_s"]) == len(fixed["step_s"]) == STRAGGLER["steps"]
    # Unheld ranks share two cores: before the slowdown the scheduler alone can set them 30%
    # apart for a window, and the tracker may follow that (its noise rules have their own
    # tests). What must come is the re-plan away from the straggler once it slows.
    after = [h for h in tracked["history"] if h["step"] > STRAGGLER["slow_at"]]
    assert after, f"no re-plan after the slowdown; the tracker decided {tracked['decisions']}"
    speeds = np.array(after[0]["speeds"])
    assert int(np.argmin(speeds)) == 3 and speeds[3] < 0.7 * np.delete(speeds, 3).min()
    assert tracked["slow_rank_share_after"] < tracked["slow_rank_share_before"]
    assert fixed["slow_rank_share_after"] == fixed["slow_rank_share_before"]
    assert_close(tracked["losses"], fixed["losses"], rtol=1e-9, atol=1e-12)
    # the re-split of every layer follows the adopted speeds, the same on every rank
    adopted = tracked["history"][-1]["speeds"]
    assert tracked["topology_speed"] == adopted
    assert all(s == pytest.approx(adopted) for s in tracked["resplit_speeds"])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tracked["resplit_speeds"])
    assert all(e == everyone[0] for e in everyone)


CASES = [measure_agrees_on_every_rank, measure_error_raises_on_every_rank,
         straggler_replans_away_from_the_slow_rank]


# quiet: the speed tracker must tell the straggler from the machine's noise
dist_results = shared_spawn(CASES, __name__, world_size=4, timeout_s=240, quiet=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_distributed(dist_results, case):
    dist_results.check(case)


def test_set_device_speeds_reaches_every_dispatcher_and_rebuilds_its_tables():
    from moebalance.nn.slots import set_device_speeds

    moe = _layer()
    x = torch.randn(10, 16)
    before = moe(x)
    state = moe.dispatcher._state(moe.placement, 0)
    assert state.speeds == (1.0,)
    set_device_speeds(torch.nn.Sequential(moe), [0.5])
    assert moe.dispatcher.speeds == (0.5,)
    assert moe.dispatcher._state(moe.placement, 0).speeds == (0.5,)   # rebuilt, not cached
    assert_close(moe(x), before)                 # the re-split changes routing, never the math
    with pytest.raises(ValueError, match="speeds must give a finite speed > 0 for each of the 1"):
        set_device_speeds(moe, [1.0, 0.5])
    with pytest.raises(ValueError, match="speeds must give"):
        moe.dispatcher.set_speeds([0.0])


def test_tracker_state_round_trip_continues_the_same_figures():
    tracker = SpeedTracker(2, min_change=0.1, window=2)
    figures = np.stack([np.ones((6, 2)), np.stack([np.ones(6), np.r_[1, 1, 2, 2, 2, 2]], -1)])
    tracker.update(figures)
    tracker.steps = 6
    state = tracker.state_dict()
    back = SpeedTracker(2, min_change=0.1, window=2)
    back.load_state_dict(state)
    assert back.steps == 6 and back.expert_s == tracker.expert_s
    assert_close(back.speed, tracker.speed)
    assert len(back.history) == 2 and back.moved([1.0, 1.0]) == tracker.moved([1.0, 1.0])
    assert_close(back.planning_speeds(), tracker.planning_speeds())
    more = figures[:, -2:]
    tracker.update(more)
    back.update(more)
    assert_close(back.speed, tracker.speed)
    with pytest.raises(ValueError, match="no expert-parallel layer"):
        SpeedTracker().attach(torch.nn.Linear(2, 2))
