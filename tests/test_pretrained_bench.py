"""moebalance bench pretrained runs both loads on every rank and reports memory and logits."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_bench_pretrained_command_reports_its_figures(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moebalance", "bench", "pretrained", "--quick",
                           "--ranks", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "largest ratio" in proc.stdout and (tmp_path / "summary.md").is_file()
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert set(results) == {"from_pretrained", "whole_then_wrap"}
    for rows in results.values():
        assert [r["rank"] for r in rows] == [0, 1]
        assert all(r["max_abs_diff"] < 1e-5 for r in rows)       # the plain model's logits
    # Reading only this rank's experts adds less than building the whole model.
    for ours, whole in zip(results["from_pretrained"], results["whole_then_wrap"]):
        assert ours["held_mb"] == whole["held_mb"]                # same slots either way
        assert 0 < ours["added_mb"] < whole["added_mb"]
