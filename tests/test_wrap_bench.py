"""moebalance bench wrap runs and reports the three setups and the wrapper's overhead."""

from __future__ import annotations

import importlib.util
import json

import pytest


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.timeout(400)
def test_bench_wrap_command_reports_its_figures(tmp_path, run_moebalance):
    # 2 ranks (the command's default is 4): each rank costs its imports; the wrapped model's
    # training on 4 ranks is checked by test_wrap_distributed
    rc, out, err = run_moebalance(["bench", "wrap", "--quick", "--hidden", "32", "--seq", "16",
                                   "--batch", "2", "--ranks", "2", "--out", tmp_path])
    assert rc == 0, err[-3000:]
    assert "moebalance wrap, 2 gloo ranks" in out and "wrapper overhead" in out
    assert "moebalance bench wrap [" in err and "spawning 2 gloo ranks" in err
    result = json.loads((tmp_path / "results.json").read_text())["result"]
    assert len(result["wrapped_s"]) == 4          # the timed steps of --quick
    assert len(result["glue_share"]) == 2         # one per rank
    assert all(0 <= g < 1 for g in result["glue_share"])
