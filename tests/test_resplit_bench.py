"""The per-step re-split benchmark: on a short random trace its figures are ordered as they must
be (the LP optimum is the floor of both other figures) and the command line reaches it."""

from __future__ import annotations

import numpy as np
import pytest

from moebalance.cli.main import main as cli_main
from moebalance.lab.bench import resplit


def test_run_trace_scores_every_following_step_above_the_lp_floor():
    counts = np.random.default_rng(0).integers(0, 200, (6, 2, 16)).astype(np.float64)
    rows = resplit.run_trace("random", counts, window=2, max_windows=0, sweeps=16)
    assert [r.cluster.split("-")[1] for r in rows] == ["homogeneous", "heterogeneous"]
    for r in rows:
        assert r.steps == 4                              # windows 1 and 2 scored, 2 steps each
        assert r.optimum >= 1.0 - 1e-9
        assert r.resplit >= r.optimum - 1e-9 and r.static >= r.optimum - 1e-9
        assert r.gap < 0.01


def test_a_trace_shorter_than_two_windows_is_a_usage_error():
    with pytest.raises(resplit.UsageError, match="--window"):
        resplit.run_trace("random", np.ones((3, 1, 16)), window=2, max_windows=0, sweeps=4)


def test_bench_resplit_is_reachable_from_the_command_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "resplit", "--help"])
    assert exc.value.code == 0
    assert "re-split" in capsys.readouterr().out
