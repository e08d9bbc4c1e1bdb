"""The runnable examples run, end to end, as a user would run them, each at its ``--quick`` size.

The launcher itself (spawning the ranks here, or one process per rank under torchrun, with the
same losses) is checked on the examples whose every loop runs both ways: ``expert_parallel_gloo``
and ``train_rebalance --loop all`` (the plain loop, DDP, the HF Trainer with its own DDP under
torchrun and Lightning) start both runs at once and compare the ``mean training loss`` lines
they print; ``frameworks_agree`` splits its loops between the two. The single-framework examples
run once each, the way their own code differs most: ``hf_trainer_rebalance`` under torchrun (it
hands the Trainer every rank's rows to shard), ``lightning_rebalance`` spawned (it sets
LOCAL_RANK so Lightning joins the spawned ranks).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Both runs of a pair must end within this (seconds). Idle, a pair takes well under a minute;
# on a loaded 2-core machine several minutes. pytest-timeout's own limit sits just above it.
TIMEOUT_S = 900
pair_timeout = pytest.mark.timeout(TIMEOUT_S + 60)

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                              or importlib.util.find_spec("accelerate") is None,
                              reason="needs transformers and accelerate")
needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="needs Lightning")


def _command(name: str, args, torchrun: bool, nproc: int = 4) -> list[str]:
    # ``python -m torch.distributed.run`` is the torchrun console script, without needing PATH.
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                if torchrun else [])
    return [sys.executable, *launcher, str(EXAMPLES / name), *map(str, args)]


def _run_all(name: str, runs) -> list[str]:
    """stdout of each ``(args, torchrun)`` run of the example (4 ranks), run side by side."""
    procs = [subprocess.Popen(_command(name, args, torchrun), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for args, torchrun in runs]
    outputs = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for (_, torchrun), (code, _out, err) in zip(runs, outputs):
        how = "under torchrun" if torchrun else "spawned"
        assert code == 0, f"{name} {how} failed:\n{err[-3000:]}"
    return [out for _, out, _ in outputs]


def _run_both(name: str, spawned_args=(), torchrun_args=()) -> tuple[str, str]:
    """stdout of the example spawned and under torchrun (4 ranks), run side by side."""
    spawned, torchrun = _run_all(name, ((spawned_args, False), (torchrun_args, True)))
    return spawned, torchrun


def _mean_losses(out: str) -> list[float]:
    """Every ``mean training loss over N steps (all ranks): X`` figure printed, in order."""
    found = re.findall(r"^mean training loss over \d+ steps \(all ranks\): ([0-9.eE+-]+)", out,
                       flags=re.MULTILINE)
    assert found, f"no mean training loss line in:\n{out[-2000:]}"
    return [float(x) for x in found]


@pytest.mark.distributed
@pair_timeout
def test_expert_parallel_example_trains_alike_spawned_and_under_torchrun():
    spawned, torchrun = _run_both("expert_parallel_gloo.py", ["--quick"], ["--quick"])
    for out in (spawned, torchrun):
        assert "imbalance before" in out and "moves" in out
    # Only rank 0 prints the summary: one process per rank, not four spawning their own.
    assert torchrun.count("imbalance before") == 1 and "device 3 (speed 0.5)" in torchrun
    assert _mean_losses(torchrun) == pytest.approx(_mean_losses(spawned), rel=1e-6)


@pytest.mark.distributed
def test_expert_parallel_example_under_torchrun_names_the_ranks_it_needs():
    proc = subprocess.run(_command("expert_parallel_gloo.py", ["--steps", "1"], True, nproc=2),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--nproc-per-node 4" in proc.stderr


@pytest.mark.distributed
@needs_hf
@needs_lightning
@pair_timeout
def test_train_rebalance_example_every_loop_trains_alike_spawned_and_under_torchrun(tmp_path):
    # --loop all: the plain loop, the user's DDP, the HF Trainer (its own DDP under torchrun) and
    # L.Trainer(devices=4, strategy="ddp"), one after another in one group: 8 runs, 1 loss.
    spawned, torchrun = _run_both(
        "train_rebalance.py", ["--quick", "--loop", "all", "--out", tmp_path / "s.png"],
        ["--quick", "--loop", "all", "--out", tmp_path / "t.png"])
    losses = _mean_losses(spawned) + _mean_losses(torchrun)
    assert len(losses) == 8
    # fp32: DDP's mean and moebalance's sum of the dense gradients round differently.
    assert losses == pytest.approx([losses[0]] * 8, rel=1e-5)
    for out in (spawned, torchrun):
        assert "re-plan:" in out and "what rebalancing bought: per-step imbalance" in out
        # The replicas were bit-identical (checked in the example) and every loop's weights,
        # experts by id, match the plain loop's: no framework overwrote a rank's slots.
        drifts = [float(x) for x in re.findall(r"max \|difference\| ([0-9.eE+-]+)", out)]
        assert len(drifts) == 4 and max(drifts) < 1e-4, drifts
    for prefix in ("s", "t"):
        for loop in ("plain", "ddp", "hf", "lightning"):
            rows = json.loads((tmp_path / f"{prefix}_{loop}.json").read_text())
            assert len(rows) == 6 and (tmp_path / f"{prefix}_{loop}.png").is_file()


@pytest.mark.distributed
@needs_hf
@pair_timeout
def test_hf_trainer_example_trains_under_torchrun(tmp_path):
    # Under torchrun the Trainer's DDP averages the dense part and its sampler shards the rows the
    # example hands it (every rank's); that each loop trains alike both ways is checked by
    # train_rebalance --loop all and frameworks_agree.
    (out,) = _run_all("hf_trainer_rebalance.py",
                      [(["--quick", "--out", tmp_path / "torchrun"], True)])
    assert len(_mean_losses(out)) == 1
    assert "re-plan:" in out and "what rebalancing bought: per-step imbalance" in out
    assert (tmp_path / "torchrun" / "config.json").is_file()
    assert (tmp_path / "torchrun" / "moebalance_placement.npz").is_file()


@pytest.mark.distributed
@needs_hf
@needs_lightning
@pair_timeout
def test_lightning_example_trains_spawned():
    # L.Trainer(devices=4, strategy="ddp"), spawned: the example sets LOCAL_RANK so Lightning
    # joins the spawned ranks (under torchrun Lightning finds torchrun's ranks: checked by
    # train_rebalance --loop all).
    (out,) = _run_all("lightning_rebalance.py", [(["--quick"], False)])
    assert len(_mean_losses(out)) == 1
    assert "re-plan:" in out and "moves" in out
    assert "what rebalancing bought: per-step imbalance" in out


@pytest.mark.distributed
@needs_hf
@needs_lightning
@pair_timeout
def test_frameworks_example_every_framework_trains_alike_spawned_and_under_torchrun(tmp_path):
    # fp64: the hand-written loop and Lightning spawned, the user's DDP and the HF Trainer (its
    # own DDP) under torchrun, each loop once; every loss sequence is the plain loop's.
    spawned, torchrun = _run_both(
        "frameworks_agree.py",
        ["--quick", "--loops", "plain,lightning", "--json", tmp_path / "s.json"],
        ["--quick", "--loops", "ddp,hf", "--json", tmp_path / "t.json"])
    runs = {}
    for name in ("s.json", "t.json"):
        runs.update(json.loads((tmp_path / name).read_text())["runs"])
    assert sorted(runs) == ["spawned lightning", "spawned plain", "torchrun ddp", "torchrun hf"]
    reference = runs["spawned plain"]["losses"]
    assert len(reference) == 4
    for name, run in runs.items():
        assert run["losses"] == pytest.approx(reference, rel=1e-9), name
        assert run["replicas_identical"] is True and run["replans"] == 2, name
