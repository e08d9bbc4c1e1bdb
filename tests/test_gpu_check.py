"""benchmarks/gpu_check.py: its CPU forms of the checks pass, it stops cleanly without a GPU,
and its arguments parse. (Its CUDA checks need a GPU and run there only.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_checks_pass_and_write_json(gpu_check, tmp_path):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["status"] == "passed" and report["device"] == "cpu"
    assert [c["check"] for c in report["checks"]] == [
        "kernels (Numba)", "experts (grouped GEMM vs slot loop)",
        "moe (ExpertParallelMoE vs DenseMoE)"]
    assert all(c["ok"] for c in report["checks"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_without_a_gpu_it_says_so_and_exits_zero(gpu_check, tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert "no CUDA GPU is visible" in capsys.readouterr().out
    assert json.loads(out.read_text())["status"] == "no-gpu"


def test_a_failing_check_is_recorded_and_the_run_goes_on(gpu_check):
    results = gpu_check.Results()

    def broken():
        raise AssertionError("differs")

    results.run("broken", broken)
    results.run("fine", lambda: "ok")
    assert results.failed == 1 and [c["ok"] for c in results.checks] == [False, True]
    assert "FAIL" in results.table() and "AssertionError: differs" in results.table()


def test_kernel_inputs_are_valid_routed_pairs(gpu_check):
    for shape in gpu_check.KERNEL_SHAPES:
        T, K, E, S, D = shape
        ids, (rank_TK, slots_EX, bounds_EX), x, w = gpu_check.kernel_inputs(shape, 1, torch.float32)
        assert ids.shape == rank_TK.shape == w.shape == (T, K) and x.shape == (T, D)
        assert slots_EX.shape[0] == E and int(slots_EX.max()) < S


def test_bad_device_is_a_usage_error(gpu_check):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--device", "tpu"])
