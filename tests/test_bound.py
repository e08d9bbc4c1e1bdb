"""``moebalance bench bound``: the floor under every placement of a layer (a HiGHS program)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from scipy.optimize import linprog

import moebalance as mb
from moebalance.cli import main as cli
from moebalance.lab.bench.bound import placement_floor


def best_by_enumeration(load_E: np.ndarray, topology: mb.Topology) -> float:
    """The reference: every choice of replica sets within the slots, each with its best shares
    (a linear program), the best of them; in units of the ideal time."""
    E, G = load_E.shape[0], topology.num_devices
    w_E = load_E / (load_E.sum() / topology.speed.sum())
    choices = [[s for k in range(1, int(topology.slots[g]) + 1)
                for s in itertools.combinations(range(E), k)] for g in range(G)]
    best = np.inf
    for sets in itertools.product(*choices):
        held = np.zeros((E, G), dtype=bool)
        for g, experts in enumerate(sets):
            held[list(experts), g] = True
        if not held.any(axis=1).all():
            continue
        # variables x[e, g] (held pairs only), then T
        pairs = np.argwhere(held)
        n = len(pairs)
        cost = np.r_[np.zeros(n), 1.0]
        a_eq = np.zeros((E, n + 1))
        a_eq[pairs[:, 0], np.arange(n)] = 1
        a_ub = np.zeros((G, n + 1))
        a_ub[pairs[:, 1], np.arange(n)] = w_E[pairs[:, 0]]
        a_ub[:, n] = -topology.speed
        res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(G), A_eq=a_eq, b_eq=np.ones(E),
                      bounds=[(0, 1)] * n + [(0, None)])
        best = min(best, res.fun)
    return best


def test_the_floor_of_small_layers_is_the_best_placement():
    two = mb.Topology.from_arrays([1.0, 1.0], [2, 2], [0, 0])
    assert placement_floor(np.array([2.0, 1.0, 1.0]), two).floor == pytest.approx(1.0)
    single = mb.Topology.from_arrays([1.0, 1.0], [1, 1], [0, 0])
    b = placement_floor(np.array([3.0, 1.0]), single)
    assert b.optimal and b.floor == pytest.approx(1.5) and b.best == pytest.approx(1.5)
    unlike = mb.Topology.from_arrays([1.0, 0.5], [1, 1], [0, 0])
    assert placement_floor(np.array([3.0, 1.0]), unlike).floor == pytest.approx(3 / (4 / 1.5))
    assert placement_floor(np.zeros(3), two).floor == 1.0


@pytest.mark.parametrize("seed", range(4))
def test_the_floor_equals_enumeration_and_lies_under_the_planner(seed):
    rng = np.random.default_rng(seed)
    G = 2 + seed % 2
    topology = mb.Topology.from_arrays(rng.choice([0.5, 1.0, 2.0], G), rng.integers(1, 3, G),
                                       np.zeros(G, dtype=int))
    E = int(min(topology.slots.sum(), 3 + seed % 2))
    load_E = rng.gamma(0.7, 10.0, E) + 0.1
    b = placement_floor(load_E, topology, time_limit=10)
    assert b.optimal
    assert b.floor == pytest.approx(best_by_enumeration(load_E, topology), rel=1e-6)
    planned = mb.imbalance(load_E[None], mb.plan(load_E[None], topology), topology)[0]
    assert planned >= b.floor - 1e-9


def test_bench_bound_command_reports_the_planner_against_the_floor(tmp_path, capsys):
    rc = cli.main(["bench", "bound", "--cluster", "homogeneous-288", "--layers", "0",
                   "--time-limit", "0.5", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "over a layer's floor" in out
    record = json.loads((tmp_path / "results.json").read_text())
    (layer,) = record["layers"]
    assert layer["layer"] == 0 and 1.0 <= layer["floor"] <= layer["planner"] + 1e-9
    assert (tmp_path / "summary.md").read_text().startswith("# moebalance bench bound")


@pytest.mark.parametrize("argv, message", [
    (["--layers", "99"], "--layers [99]: the loads have layers 0..57"),
    (["--layers", "a,b"], "--layers must be layer numbers"),
    (["--time-limit", "0"], "--time-limit must be seconds > 0"),
])
def test_bench_bound_refuses_bad_arguments_in_one_line(argv, message, tmp_path, capsys):
    rc = cli.main(["bench", "bound", *argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
