"""The runnable examples run, end to end, as a user would run them, each at its ``--quick`` size.

Each launch costs every rank its imports (torch, its compiler stack on the first optimizer,
Lightning), so every example runs once, under the launcher its own code differs for most, and
the launchers are split between the examples that run every loop:

* ``expert_parallel_gloo`` spawned and under torchrun at once: the same losses both ways (the
  launcher itself: one process per rank under torchrun, four spawned ranks otherwise);
* ``train_rebalance --loop all`` spawned: the plain loop, the user's DDP, the HF Trainer and
  ``L.Trainer(devices=4, strategy="ddp")`` train alike (fp32) in the spawned ranks;
* ``frameworks_agree`` under torchrun: the same four loops, fp64, equal losses to 1e-9, each
  framework finding torchrun's ranks (the HF Trainer with its own DDP);
* ``hf_trainer_rebalance`` and ``lightning_rebalance`` spawned (the Trainer's sampler shards the
  rows it is handed; the Lightning example sets LOCAL_RANK so Lightning joins the spawned ranks).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from _launches import Launch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                              or importlib.util.find_spec("accelerate") is None,
                              reason="needs transformers and accelerate")
needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="needs Lightning")


def _example(label: str, name: str, args, seconds: float, torchrun: bool,
             nproc: int = 4) -> Launch:
    # ``python -m torch.distributed.run`` is the torchrun console script, without needing PATH.
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                if torchrun else [])
    return Launch(label, [sys.executable, *launcher, str(EXAMPLES / name), *map(str, args)],
                  seconds)


# The launches each test reads, by test name (run in the background: see ``_launches.py``).
LAUNCHES = {
    "test_expert_parallel_example_trains_alike_spawned_and_under_torchrun": [
        _example("ep spawned", "expert_parallel_gloo.py", ["--quick"], 8, torchrun=False),
        _example("ep torchrun", "expert_parallel_gloo.py", ["--quick"], 9, torchrun=True)],
    "test_expert_parallel_example_under_torchrun_names_the_ranks_it_needs": [
        _example("ep 2 ranks", "expert_parallel_gloo.py", ["--steps", "1"], 3, torchrun=True,
                 nproc=2)],
    "test_train_rebalance_example_every_loop_trains_alike_spawned": [
        _example("train_rebalance", "train_rebalance.py",
                 ["--quick", "--loop", "all", "--out", "{out}/s.png"], 22, torchrun=False)],
    "test_hf_trainer_example_trains_spawned": [
        _example("hf", "hf_trainer_rebalance.py", ["--quick", "--out", "{out}/model"], 12,
                 torchrun=False)],
    "test_lightning_example_trains_spawned": [
        _example("lightning", "lightning_rebalance.py", ["--quick"], 17, torchrun=False)],
    "test_frameworks_example_every_framework_trains_alike_under_torchrun": [
        _example("frameworks", "frameworks_agree.py", ["--quick", "--json", "{out}/t.json"], 22,
                 torchrun=True)],
}


def _mean_losses(out: str) -> list[float]:
    """Every ``mean training loss over N steps (all ranks): X`` figure printed, in order."""
    found = re.findall(r"^mean training loss over \d+ steps \(all ranks\): ([0-9.eE+-]+)", out,
                       flags=re.MULTILINE)
    assert found, f"no mean training loss line in:\n{out[-2000:]}"
    return [float(x) for x in found]


@pytest.mark.distributed
def test_expert_parallel_example_trains_alike_spawned_and_under_torchrun(launches):
    spawned, torchrun = launches.output("ep spawned"), launches.output("ep torchrun")
    for out in (spawned, torchrun):
        assert "imbalance before" in out and "moves" in out
    # Only rank 0 prints the summary: one process per rank, not four spawning their own.
    assert torchrun.count("imbalance before") == 1 and "device 3 (speed 0.5)" in torchrun
    assert _mean_losses(torchrun) == pytest.approx(_mean_losses(spawned), rel=1e-6)


@pytest.mark.distributed
def test_expert_parallel_example_under_torchrun_names_the_ranks_it_needs(launches):
    code, _, err = launches.result("ep 2 ranks")
    assert code != 0
    assert "--nproc-per-node 4" in err


def test_require_world_size_stops_each_rank_with_one_line_naming_the_command():
    from moebalance.launch import require_world_size

    require_world_size(4, 4)
    with pytest.raises(SystemExit, match=r"^this job describes 4 devices, one per rank, and runs "
                                         r"on 2 ranks: start it with torchrun --nproc-per-node 4"):
        require_world_size(2, 4)


@pytest.mark.distributed
@needs_hf
@needs_lightning
def test_train_rebalance_example_every_loop_trains_alike_spawned(launches):
    # --loop all: the plain loop, the user's DDP, the HF Trainer and L.Trainer(devices=4,
    # strategy="ddp"), one after another in the spawned ranks (under torchrun: frameworks_agree).
    out = launches.output("train_rebalance")
    losses = _mean_losses(out)
    assert len(losses) == 4
    # fp32: DDP's mean and moebalance's sum of the dense gradients round differently.
    assert losses == pytest.approx([losses[0]] * 4, rel=1e-5)
    assert "re-plan:" in out and "what rebalancing bought: per-step imbalance" in out
    # The replicas were bit-identical (checked in the example) and every loop's weights,
    # experts by id, match the plain loop's: no framework overwrote a rank's slots.
    drifts = [float(x) for x in re.findall(r"max \|difference\| ([0-9.eE+-]+)", out)]
    assert len(drifts) == 4 and max(drifts) < 1e-4, drifts
    folder = launches.folder("train_rebalance")
    for loop in ("plain", "ddp", "hf", "lightning"):
        rows = json.loads((folder / f"s_{loop}.json").read_text())
        assert len(rows) == 6 and (folder / f"s_{loop}.png").is_file()


@pytest.mark.distributed
@needs_hf
def test_hf_trainer_example_trains_spawned(launches):
    # The Trainer's DDP averages the dense part and its sampler shards the rows the example hands
    # it (every rank's), in the spawned ranks; under torchrun the Trainer finds torchrun's ranks
    # in frameworks_agree, and every loop trains alike in train_rebalance --loop all.
    out = launches.output("hf")
    assert len(_mean_losses(out)) == 1
    assert "re-plan:" in out and "what rebalancing bought: per-step imbalance" in out
    assert (launches.folder("hf") / "model" / "config.json").is_file()
    assert (launches.folder("hf") / "model" / "moebalance_placement.npz").is_file()


@pytest.mark.distributed
@needs_hf
@needs_lightning
def test_lightning_example_trains_spawned(launches):
    # L.Trainer(devices=4, strategy="ddp"), spawned: the example sets LOCAL_RANK so Lightning
    # joins the spawned ranks (under torchrun Lightning finds torchrun's ranks: checked by
    # frameworks_agree).
    out = launches.output("lightning")
    assert len(_mean_losses(out)) == 1
    assert "re-plan:" in out and "moves" in out
    assert "what rebalancing bought: per-step imbalance" in out


@pytest.mark.distributed
@needs_hf
@needs_lightning
def test_frameworks_example_every_framework_trains_alike_under_torchrun(launches):
    # fp64: the hand-written loop, the user's DDP, the HF Trainer (its own DDP) and Lightning,
    # each finding torchrun's ranks; every loss sequence is the plain loop's (spawned, every
    # loop: train_rebalance --loop all).
    out = launches.output("frameworks")
    runs = json.loads((launches.folder("frameworks") / "t.json").read_text())["runs"]
    assert sorted(runs) == ["torchrun ddp", "torchrun hf", "torchrun lightning", "torchrun plain"]
    reference = runs["torchrun plain"]["losses"]
    assert len(reference) == 4
    for name, run in runs.items():
        assert run["losses"] == pytest.approx(reference, rel=1e-9), name
        assert run["replicas_identical"] is True and run["replans"] == 2, name
        assert run["weights_vs_first"] < 1e-9, name
    assert "torchrun lightning" in out
