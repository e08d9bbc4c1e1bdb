"""moebalance bench pretrained runs both loads on every rank and reports memory and logits."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from _launches import Launch

LAUNCHES = {"test_bench_pretrained_command_reports_its_figures": [Launch(
    "bench pretrained", [sys.executable, "-m", "moebalance", "bench", "pretrained", "--quick",
                         "--ranks", "2", "--out", "{out}"], seconds=16)]}


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_bench_pretrained_command_reports_its_figures(launches):
    stdout = launches.output("bench pretrained")
    out = launches.folder("bench pretrained")
    assert "largest ratio" in stdout and (out / "summary.md").is_file()
    results = json.loads((out / "results.json").read_text())["results"]
    assert set(results) == {"from_pretrained", "whole_then_wrap"}
    for rows in results.values():
        assert [r["rank"] for r in rows] == [0, 1]
        assert all(r["max_abs_diff"] < 1e-5 for r in rows)       # the plain model's logits
    # Reading only this rank's experts adds less than building the whole model.
    for ours, whole in zip(results["from_pretrained"], results["whole_then_wrap"]):
        assert ours["held_mb"] == whole["held_mb"]                # same slots either way
        assert 0 < ours["added_mb"] < whole["added_mb"]
