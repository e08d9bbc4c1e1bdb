"""``moebalance.launch.launch`` from Python: gloo ranks forked from one server that imported
torch once still see the caller's environment and write to the caller's output as it is at each
launch, as spawned ranks would."""

from __future__ import annotations

import os

import pytest

from moebalance.launch import _start_method, launch


def _report(rank: int, world: int, tag: str) -> None:
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print(f"rank {rank}/{world} tag {tag} env {os.environ.get('MOEBALANCE_TEST_MARK')} "
          f"sum {total.item():.0f} threads {torch.get_num_threads()}", flush=True)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_forked_ranks_see_the_callers_environment_and_output_at_each_launch(capfd,
                                                                            monkeypatch):
    monkeypatch.setenv("MOEBALANCE_TEST_MARK", "first")
    launch(_report, 2, args=("a",), timeout_s=60)
    first = capfd.readouterr().out
    # The fork server now runs with the environment and output it started with; a later launch
    # must still hand its ranks the caller's current ones.
    monkeypatch.setenv("MOEBALANCE_TEST_MARK", "second")
    launch(_report, 2, args=("b",), timeout_s=60)
    second = capfd.readouterr().out
    for out, tag, mark in ((first, "a", "first"), (second, "b", "second")):
        for rank in range(2):
            assert f"rank {rank}/2 tag {tag} env {mark} sum 3 threads 1" in out, out


def test_ranks_that_must_not_fork_are_spawned():
    # NCCL: a process that touched CUDA must not fork; default thread pools: OpenMP loaded at
    # its default size in the server leaves forked ranks spinning.
    assert _start_method("nccl", 1, _report, ()) == "spawn"
    assert _start_method("gloo", None, _report, ()) == "spawn"


@pytest.mark.parametrize("preload", [("lightnig",), ("no_such_package.sub",), (3,)])
def test_a_preload_that_is_not_a_module_is_refused_before_any_rank_starts(preload):
    with pytest.raises(ValueError, match="preload names .* which is not an installed module"):
        launch(_report, 2, args=("x",), preload=preload)
