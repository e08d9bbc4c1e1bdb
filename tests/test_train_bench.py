"""moebalance bench train: the migration it applies moves what it says, and the command runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

import moebalance as mb
from moebalance.lab.bench.train import moved_placement


def test_moved_placement_moves_at_least_the_fraction_and_stays_valid():
    topology = mb.Topology.uniform(num_devices=4, slots_per_device=5)
    rng = np.random.default_rng(0)
    loads = rng.random((4, 16)) + 0.5
    current = mb.plan(loads, topology)
    new = moved_placement(current, 0.05, rng)
    new.validate(topology)
    assert new.moves_from(current) >= int(np.ceil(0.05 * current.phy2log.size))
    assert np.array_equal(new.share, current.share)


@pytest.mark.timeout(400)
def test_bench_train_command_reports_its_figures(tmp_path, run_moebalance):
    # 2 ranks (the command's default is 4): each rank costs its imports; live migration on 4
    # ranks is checked by test_live_rebalance_distributed
    rc, out, err = run_moebalance(["bench", "train", "--quick", "--hidden", "16", "--ffn", "16",
                                   "--seq", "8", "--batch", "2", "--ranks", "2", "--slots", "8",
                                   "--out", tmp_path])
    assert rc == 0, err[-3000:]
    assert "ratio to the median step" in out
    # a progress line per phase, from the parent and from rank 0
    assert "moebalance bench train [" in err and "live migrations" in err
    result = json.loads((tmp_path / "results.json").read_text())["result"]
    assert all(r["error"] is None and r["moves"] >= 4 for r in result["reports"])
    assert len(result["sync_bytes_per_rank"]) == 2 and (tmp_path / "summary.md").is_file()


def test_bench_train_rejects_slots_that_cannot_hold_the_experts(capsys):
    from moebalance.cli import main as cli

    # in this process: the check runs before any rank is spawned
    assert cli.main(["bench", "train", "--slots", "3"]) == 2
    assert "--slots 3" in capsys.readouterr().err
