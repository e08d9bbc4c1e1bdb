"""scripts/gpu_check.py: its CPU forms of the checks pass (each in its own process), it stops
cleanly without a GPU, a crashing or hanging check costs only that check, the JSON is rewritten
after every check, and it finds the repository and its CUDA sources by itself. (Its CUDA checks
need a GPU and run there only.)"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _launches import Launch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module          # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


# Run as a user would, from another directory (its own folder): the script finds the
# repository itself.
LAUNCHES = {"test_cpu_checks_pass_each_in_its_own_process": [Launch(
    "gpu_check --device cpu", [sys.executable, str(SCRIPT), "--device", "cpu", "--quick",
                               "--out", "{out}/check.json"], seconds=15)]}


def test_cpu_checks_pass_each_in_its_own_process(launches):
    stdout = launches.output("gpu_check --device cpu")
    out = launches.folder("gpu_check --device cpu") / "check.json"
    assert "--no-deps --no-build-isolation --no-index -e ." in stdout
    report = json.loads(out.read_text())
    assert report["status"] == "passed" and report["device"] == "cpu"
    assert [c["check"] for c in report["checks"]] == [
        "kernels (csrc through CuPy; Numba on cpu)", "edge inputs (misaligned, -1 ids, empty)",
        "experts (grouped GEMM vs slot loop)", "moe (ExpertParallelMoE vs DenseMoE)",
        "syncs (step + live migration)"]
    assert all(c["status"] == "PASS" for c in report["checks"])
    assert "rows 1,3,0,5,7,9,2,13 bfloat16 ok" in report["checks"][2]["detail"]
    assert "moved weights and momentum" in report["checks"][4]["detail"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_without_a_gpu_it_says_so_and_exits_zero(gpu_check, tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert "no CUDA GPU is visible" in capsys.readouterr().out
    assert json.loads(out.read_text())["status"] == "no-gpu"


def test_a_crash_or_a_hang_fails_that_check_only(gpu_check, tmp_path):
    segfault = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    result = gpu_check.run_isolated(segfault, 30, tmp_path / "none.json")
    assert not result["ok"] and "killed by SIGSEGV" in result["detail"]
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    result = gpu_check.run_isolated(hang, 2, tmp_path / "none.json")
    assert not result["ok"] and "timed out after 2 s" in result["detail"]
    assert result["seconds"] < 30
    fine = tmp_path / "fine.json"
    writer = [sys.executable, "-c", f"import json; open({str(fine)!r}, 'w').write(json.dumps("
              "{'ok': True, 'detail': 'fine'}))"]
    assert gpu_check.run_isolated(writer, 30, fine)["ok"]


def test_json_is_rewritten_after_every_check(gpu_check, tmp_path, monkeypatch):
    out = tmp_path / "check.json"
    seen = []

    def fake(command, timeout_s, result_file, env=None):
        seen.append(json.loads(out.read_text())["checks"])     # what a crash here would leave
        return {"ok": len(seen) != 2, "detail": "x", "figures": [], "seconds": 0.0,
                "output_tail": ""}

    monkeypatch.setattr(gpu_check, "run_isolated", fake)
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)]) == 1
    assert [len(checks) for checks in seen] == list(range(len(seen))) and len(seen) == 5
    report = json.loads(out.read_text())
    assert report["status"] == "failed"
    assert [c["status"] for c in report["checks"]] == ["PASS", "FAIL", "PASS", "PASS", "PASS"]


def test_only_and_sanitize_select_checks(gpu_check):
    def names(*argv):
        return [c.name for c in gpu_check.selected_checks(gpu_check.parse_args(list(argv)))]

    assert names("--only", "kernels", "--only", "syncs") == ["kernels", "syncs"]
    assert names() == ["kernels", "inputs", "experts", "moe", "no-sync", "resplit", "syncs",
                       "bandwidth"]
    assert names("--sanitize")[-2:] == ["sanitize-memcheck", "sanitize-synccheck"]
    assert "bandwidth" not in names("--quick")
    assert names("--device", "cpu", "--only", "bandwidth") == []   # no CPU form
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "nonsense"])


def test_sanitizer_checks_run_under_compute_sanitizer(gpu_check, tmp_path, monkeypatch):
    args = gpu_check.parse_args(["--sanitize"])
    check = next(c for c in gpu_check.CHECKS if c.name == "sanitize-memcheck")
    monkeypatch.setattr(gpu_check, "_sanitizer", lambda: "/opt/cuda/bin/compute-sanitizer")
    command = gpu_check._command(check, args, tmp_path / "r.json")
    assert command[:3] == ["/opt/cuda/bin/compute-sanitizer", "--tool", "memcheck"]
    assert command[command.index("--run-one") + 1] == "sanitize-memcheck"
    monkeypatch.setattr(gpu_check, "_sanitizer", lambda: None)
    assert "compute-sanitizer is not on PATH" in gpu_check._command(check, args, tmp_path / "r")


def test_cuda_sources_found_without_an_install_mapping(gpu_check):
    # With only the repository on sys.path (no install), moebalance._csrc does not exist; the
    # script maps csrc/ as the install would. Here under a probe name no install provides.
    name = "moebalance_probe_csrc"
    gpu_check.use_repository(ROOT, name)
    try:
        text = importlib.resources.files(name).joinpath("dispatch.cu").read_text()
        assert text == (ROOT / "csrc" / "dispatch.cu").read_text()
    finally:
        sys.modules.pop(name, None)


def test_kernel_inputs_are_valid_routed_pairs(gpu_check):
    for shape in gpu_check.KERNEL_SHAPES:
        T, K, E, S, D = shape
        ids, (rank_TK, slots_EX, bounds_EX), x, w = gpu_check.kernel_inputs(shape, 1, torch.float32)
        assert ids.shape == rank_TK.shape == w.shape == (T, K) and x.shape == (T, D)
        assert slots_EX.shape[0] == E and int(slots_EX.max()) < S


def test_misaligned_copies_are_contiguous_and_off_16_bytes(gpu_check):
    t = torch.randn(5, 7)
    view = gpu_check._misaligned(t, "cpu")
    assert view.is_contiguous() and torch.equal(view, t) and view.data_ptr() % 16 != 0


def test_bad_device_is_a_usage_error(gpu_check):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--device", "tpu"])


@pytest.mark.timeout(600)
def test_runs_from_the_repository_without_an_install(tmp_path):
    # python -S with only the dependencies on PYTHONPATH: no .pth file runs, so no install of
    # moebalance (editable or not) is visible; the script must import it from the repository.
    import numba
    import numpy

    paths = dict.fromkeys(str(Path(m.__file__).parents[1]) for m in (torch, numpy, numba))
    env = {"PYTHONPATH": ":".join(paths), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-S", "-c", "import moebalance"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        pytest.skip("moebalance is importable from the dependencies' directories")
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, "-S", str(SCRIPT), "--device", "cpu", "--only", "inputs",
                          "--out", str(out)], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=500)
    assert f"moebalance from {ROOT / 'moebalance'}" in run.stdout
    assert f"CUDA sources from {ROOT / 'csrc'}" in run.stdout
    assert json.loads(out.read_text())["status"] == "passed"
