"""The runnable examples run, end to end (each in its own process, as a user would run it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_expert_parallel_example_trains_tracks_and_replans():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "expert_parallel_gloo.py"), "--steps", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "imbalance before" in proc.stdout and "moves" in proc.stdout


def test_train_rebalance_example_migrates_and_plots(tmp_path):
    out = tmp_path / "train.png"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_rebalance.py"), "--steps", "8",
                           "--every", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "re-plan:" in proc.stdout and out.is_file() and out.with_suffix(".json").is_file()
