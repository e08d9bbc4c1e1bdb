"""The planner benchmark's timing rule for slow EPLB calls and its verdict table, on made-up
rows (the benchmark's own run is exercised by tests/test_cli.py)."""

from __future__ import annotations

import numpy as np

from moebalance.lab.bench import planner as bench
from moebalance.lab.bench.migration import FrontierPoint
from moebalance.lab.bench.verdict import COLUMNS, verdict_cells


def _method(name: str, seconds: float, reference: bool, calls: list) -> bench.Method:
    def run(loads, previous):
        calls.append(name)
        return name, seconds

    return bench.Method(name=name, run=run, to_placement=lambda r: r, reference=reference)


def test_a_slow_reference_call_is_timed_once_and_the_others_repeatedly():
    calls: list[str] = []
    methods = [_method("ours", 0.9, False, calls), _method("eplb slow", 0.9, True, calls),
               _method("eplb fast", 0.1, True, calls)]
    results, times = bench._timed_calls(methods, np.ones((2, 4)), repeats=3)
    assert results == ["ours", "eplb slow", "eplb fast"]
    assert calls.count("ours") == 4 and calls.count("eplb fast") == 4  # warm call + 3 timed
    assert calls.count("eplb slow") == 1 and times[1] == [900.0]       # its first call, once
    assert times[0] == [900.0] * 3 and len(times[2]) == 3


def _row(scenario, kind, skew, method, imbalance, plan_ms=1.0, moves_pct=100.0, drift=None):
    return bench.Row(workload="synthetic", scenario=scenario, kind=kind, skew=skew, method=method,
                     imbalance=imbalance, worst_layer_imbalance=imbalance, balancedness=0.9,
                     moves=0.0, moves_pct=moves_pct, plan_ms=plan_ms, plan_ms_samples=[plan_ms],
                     num_layers=2, num_slots=8, num_devices=2, drift=drift, replans=3)


def test_verdict_reads_each_figure_from_its_row():
    rows = [_row("homogeneous-320", "static", "moderate", "moebalance", 1.0, plan_ms=2.0),
            _row("homogeneous-320", "static", "moderate", "eplb (hierarchical)", 1.3, 900.0),
            _row("homogeneous-320", "static", "moderate", "eplb (hierarchical) + optimal shares",
                 1.29, 900.0),
            _row("homogeneous-320", "static", "heavy", "moebalance", 1.0, plan_ms=5.0),
            _row("homogeneous-320", "static", "heavy", "eplb (hierarchical)", 1.5, 950.0),
            _row("homogeneous-320", "drift", "moderate", "moebalance", 1.004, moves_pct=5.9,
                 drift=0.2),
            _row("homogeneous-320", "drift", "moderate", "eplb (hierarchical)", 1.3,
                 moves_pct=81.6, drift=0.2),
            _row("homogeneous-320", "drift", "moderate", "moebalance", 1.002, moves_pct=1.0,
                 drift=0.05),
            _row("trace-homogeneous-20", "static", "trace", "moebalance", 1.0, plan_ms=0.3),
            _row("trace-homogeneous-20", "static", "trace", "eplb (global)", 1.05, 36.0)]
    frontier = [FrontierPoint("synthetic", "homogeneous-320", 0.2, budget, None, value, 0.0,
                              0.0, 0.0, 0.0)
                for budget, value in (("stale", 1.39), ("keep-old", 1.28), ("unlimited", 1.004))]
    per_step = [{"scenario": "trace-homogeneous-20", "method": "moebalance (window mean)",
                 "per_step_static": 1.52, "per_step_resplit": 1.14},
                {"scenario": "trace-homogeneous-20", "method": "eplb (global) (window mean)",
                 "per_step_static": 1.67, "per_step_resplit": 1.2}]
    cells = [dict(zip(COLUMNS, c)) for c in verdict_cells(rows, frontier, per_step, 0.2)]
    assert [c["cluster"] for c in cells] == ["homogeneous-320", "trace-homogeneous-20"]
    synthetic, trace = cells
    assert synthetic["baseline"] == "eplb (hierarchical)"
    assert synthetic["imbalance"] == "1.000 / 1.300"          # the moderate skew
    assert synthetic["plan ms"] == "2.0 / 900.0"
    assert synthetic["moves / re-plan"] == "5.9% / 81.6%"     # the 20% drift, not the 5%
    assert synthetic["stale > re-split > re-plan"] == "1.390 > 1.280 > 1.004"
    assert synthetic["per step (re-split)"] == "-"            # synthetic loads have no steps
    assert trace["per step (re-split)"] == "1.520 / 1.670 (1.140)"
    assert trace["moves / re-plan"] == "-" and trace["imbalance"] == "1.000 / 1.050"
