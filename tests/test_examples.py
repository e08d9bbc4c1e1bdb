"""The runnable examples run, end to end (each in its own process, as a user would run it):
spawning their ranks themselves, and as one process per rank under torchrun."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_expert_parallel_example_trains_tracks_and_replans():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "expert_parallel_gloo.py"), "--steps", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "imbalance before" in proc.stdout and "moves" in proc.stdout


@pytest.mark.distributed
def test_expert_parallel_example_runs_under_torchrun():
    # ``python -m torch.distributed.run`` is the torchrun console script, without needing it on PATH.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", str(EXAMPLES / "expert_parallel_gloo.py"),
                           "--steps", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Only rank 0 prints the summary: one process per rank, not four spawning their own.
    assert proc.stdout.count("imbalance before") == 1 and "device 3 (speed 0.5)" in proc.stdout


@pytest.mark.distributed
def test_expert_parallel_example_under_torchrun_names_the_ranks_it_needs():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(EXAMPLES / "expert_parallel_gloo.py"),
                           "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--nproc-per-node 4" in proc.stderr


def test_train_rebalance_example_migrates_and_plots(tmp_path):
    out = tmp_path / "train.png"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_rebalance.py"), "--steps", "8",
                           "--every", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "re-plan:" in proc.stdout and out.is_file() and out.with_suffix(".json").is_file()


def _run_example(name: str, *args: str, timeout: int = 500) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                    or importlib.util.find_spec("accelerate") is None,
                    reason="needs transformers and accelerate")
def test_hf_trainer_example_trains_a_wrapped_model_with_a_live_migration(tmp_path):
    out = _run_example("hf_trainer_rebalance.py", "--steps", "6", "--every", "3",
                       "--out", str(tmp_path / "ckpt"))
    assert "re-plan:" in out and " 0 moves" not in out.split("re-plan:")[1].split("\n")[0]
    assert (tmp_path / "ckpt" / "config.json").is_file()
    assert (tmp_path / "ckpt" / "moebalance_placement.npz").is_file()


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs Lightning")
def test_lightning_example_trains_a_wrapped_model_with_a_live_migration():
    out = _run_example("lightning_rebalance.py", "--steps", "6", "--every", "3")
    assert "re-plan:" in out and "moves" in out


def _mean_loss(out: str) -> float:
    line = next(x for x in out.splitlines() if x.startswith("mean training loss"))
    return float(line.rsplit(":", 1)[1])


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                    or importlib.util.find_spec("accelerate") is None,
                    reason="needs transformers and accelerate")
def test_hf_trainer_example_under_torchrun_trains_like_spawned():
    # Under torchrun the Trainer's DDP averages the dense part and its sampler shards the whole
    # dataset once; spawned, wrap averages and each rank gets its rows: the same losses.
    spawned = _run_example("hf_trainer_rebalance.py", "--quick")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", str(EXAMPLES / "hf_trainer_rebalance.py"),
                           "--quick"], capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _mean_loss(proc.stdout) == pytest.approx(_mean_loss(spawned), rel=1e-5)


@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs Lightning")
def test_train_rebalance_example_lightning_loop_runs(tmp_path):
    out = _run_example("train_rebalance.py", "--loop", "lightning", "--steps", "4", "--every", "2",
                       "--out", str(tmp_path / "l.png"))
    assert "re-plan:" in out
