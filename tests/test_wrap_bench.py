"""moebalance bench wrap runs and reports the three setups and the wrapper's overhead."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_bench_wrap_command_reports_its_figures(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moebalance", "bench", "wrap", "--quick",
                           "--hidden", "32", "--seq", "16", "--batch", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "moebalance wrap, 4 gloo ranks" in proc.stdout and "wrapper overhead" in proc.stdout
    assert "moebalance bench wrap [" in proc.stderr and "spawning 4 gloo ranks" in proc.stderr
    result = json.loads((tmp_path / "results.json").read_text())["result"]
    assert len(result["wrapped_s"]) == 4 and len(result["glue_share"]) == 4
    assert all(0 <= g < 1 for g in result["glue_share"])
