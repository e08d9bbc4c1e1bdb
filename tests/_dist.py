"""Run many torch.distributed test cases in ONE spawn of gloo worker processes.

Spawning ranks costs seconds, so a test module lists its cases -- module-level functions that
take no arguments and run on every rank with the default process group initialised -- runs
them all in one spawn (a module-scoped fixture) and reports each case as its own pytest test::

    CASES = [outputs_match_dense, replicas_identical_after_step, ...]

    @pytest.fixture(scope="module")
    def dist_results():
        return run_cases(CASES, world_size=4)

    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_distributed(dist_results, case):
        dist_results.check(case)

Every rank runs the cases in list order. A case passes when it returns on every rank. When a
case raises on some rank, that rank stops (the others may be waiting in a collective it will
never join; they fail at the collective timeout), and the later cases are reported as not run.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import pytest


def case_id(case) -> str:
    """The name a case is reported under."""
    return case.__name__


def _write(path: str, results: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, path)


def _worker(rank: int, world_size: int, init_file: str, result_dir: str, cases: list,
            collective_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    # Ranks share few cores: one thread each keeps them from starving one another.
    torch.set_num_threads(1)
    if importlib.util.find_spec("numba") is not None:
        import numba

        numba.set_num_threads(1)
    path = os.path.join(result_dir, f"rank{rank}.json")
    results: dict = {}
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=collective_timeout_s))
    failed = False
    for case in cases:
        start = time.perf_counter()
        try:
            case()
        except BaseException:  # report everything, including assertion errors
            results[case_id(case)] = {"ok": False, "error": traceback.format_exc()}
            failed = True
        else:
            results[case_id(case)] = {"ok": True, "seconds": time.perf_counter() - start}
        _write(path, results)
        if failed:
            break
    if not failed:
        dist.destroy_process_group()


@dataclass
class DistResults:
    """Per-rank outcome of every case of one spawn."""

    world_size: int
    per_rank: list       # [world_size] dicts: case name -> {"ok": bool, "error"/"seconds": ...}
    exitcodes: list

    def check(self, case) -> None:
        """Fail the calling pytest test unless ``case`` passed on every rank."""
        name = case_id(case)
        errors = []
        for rank, results in enumerate(self.per_rank):
            outcome = results.get(name)
            if outcome is None:
                errors.append(f"rank {rank}: not run (an earlier case failed, or the worker died "
                              f"with exit code {self.exitcodes[rank]})")
            elif not outcome["ok"]:
                errors.append(f"rank {rank}:\n{outcome['error']}")
        if errors:
            pytest.fail(f"distributed case {name} failed:\n" + "\n".join(errors), pytrace=False)


def run_cases(cases: list, world_size: int = 4, timeout_s: float = 300.0,
              collective_timeout_s: float = 30.0) -> DistResults:
    """Run ``cases`` on ``world_size`` gloo ranks in one spawn and collect their outcomes.

    Args:
        cases: module-level functions (picklable by reference), run in order on every rank.
        world_size: ranks to spawn.
        timeout_s: wall-clock limit for the whole spawn; ranks still alive then are killed.
        collective_timeout_s: gloo timeout, so a rank waiting on a failed peer gives up.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moebalance-dist-") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(rank, world_size, init_file, tmp, list(cases), collective_timeout_s))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        per_rank = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    per_rank.append(json.load(f))
            else:
                per_rank.append({})
    return DistResults(world_size, per_rank, [p.exitcode for p in procs])
