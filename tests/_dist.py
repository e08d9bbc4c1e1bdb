"""Run the torch.distributed test cases of every test file in ONE set of gloo worker processes.

Starting ranks costs seconds (torch, transformers, ... to import), so the whole session shares one
set of ranks per world size, forked from a server that imported them once. A test module lists
its cases -- module-level functions that take no arguments and run on every rank with the
default process group initialised -- and registers them as its group; each case is reported as
its own pytest test::

    CASES = [outputs_match_dense, replicas_identical_after_step, ...]

    dist_results = shared_spawn(CASES, __name__, world_size=4)

    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_distributed(dist_results, case):
        dist_results.check(case)

The ranks start when the first selected group is needed and run each group only when pytest asks
for it (so no rank works in the background of other tests), in a fresh process group with that
group's collective timeout. Every rank runs a group's cases in list order. A case passes when it
returns on every rank. When a case raises on some rank, that rank stops the group (the others may
be waiting in a collective it will never join; they fail at the collective timeout), the group's
later cases are reported as not run, and the next group starts in a new process group. A group
that runs past its ``timeout_s`` (counted from when pytest asked for it) kills the ranks: it and
every later group fail.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import pytest


def case_id(case) -> str:
    """The name a case is reported under."""
    return case.__name__


@dataclass
class Group:
    """The cases of one test module, run in order in their own process group."""

    name: str
    cases: list
    world_size: int
    timeout_s: float
    collective_timeout_s: float
    preload: tuple = ()
    backend: str | None = "gloo"


# Every group registered by an imported test module, by module name.
_GROUPS: dict[str, Group] = {}


def _write(path: str, state: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def _wait_for_turn(control_dir: str, index: int) -> str:
    """'run' when the parent asks for group ``index``, 'skip' when it asked for a later one
    instead, 'stop' when the session ends."""
    while True:
        names = os.listdir(control_dir)
        if f"go{index}" in names:
            return "run"
        if "stop" in names:
            return "stop"
        if any(n.startswith("go") and int(n[2:]) > index for n in names):
            return "skip"
        time.sleep(0.02)


def _run_group(group: Group, rank: int, init_file: str, record) -> None:
    import torch.distributed as dist

    # backend None: what init_process_group() picks by itself ("undefined", gloo for the CPU)
    dist.init_process_group(group.backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=group.world_size,
                            timeout=timedelta(seconds=group.collective_timeout_s))
    try:
        for case in group.cases:
            start = time.perf_counter()
            try:
                case()
            except BaseException:  # report everything, including assertion errors
                record(case, {"ok": False, "error": traceback.format_exc()})
                break
            record(case, {"ok": True, "seconds": time.perf_counter() - start})
    finally:
        # A failed case may leave peers waiting: a fresh group per test module keeps the next
        # module's collectives apart from this one's.
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker(rank: int, groups: list, tmp: str, environ: dict) -> None:
    import torch

    # Forked from the fork server: take the parent's environment, as a spawned rank would.
    os.environ.clear()
    os.environ.update(environ)

    # Ranks share few cores: one thread each keeps them from starving one another.
    torch.set_num_threads(1)
    if importlib.util.find_spec("numba") is not None:
        import numba

        numba.set_num_threads(1)
    path = os.path.join(tmp, f"rank{rank}.json")
    state: dict = {"results": {}, "done": []}

    for index, group in enumerate(groups):
        turn = _wait_for_turn(tmp, index)
        if turn == "stop":
            return
        if turn == "skip":
            continue
        results = state["results"].setdefault(group.name, {})
        # Leave what earlier groups imported (torch, transformers, Lightning: millions of
        # objects) out of the collector's scans: a full collection walks every tracked object,
        # about 0.4 s at a time here, and these ranks run many steps of small allocations.
        gc.collect()
        gc.freeze()

        def record(case, outcome, results=results):
            results[case_id(case)] = outcome
            _write(path, state)

        try:
            _run_group(group, rank, os.path.join(tmp, f"init{index}"), record)
        except BaseException:  # setting up or tearing down the group failed: the group fails
            results["<group>"] = {"ok": False, "error": traceback.format_exc()}
        state["done"].append(group.name)
        _write(path, state)


@dataclass
class DistResults:
    """Per-rank outcome of every case of one group."""

    world_size: int
    per_rank: list       # [world_size] dicts: case name -> {"ok": bool, "error"/"seconds": ...}
    exitcodes: list      # None for a rank still alive
    note: str = ""       # why the group did not finish, when it did not

    def check(self, case) -> None:
        """Fail the calling pytest test unless ``case`` passed on every rank."""
        name = case_id(case)
        errors = []
        for rank, results in enumerate(self.per_rank):
            outcome = results.get(name)
            if outcome is None:
                group_error = results.get("<group>")
                if group_error:
                    why = f"the process group failed:\n{group_error['error']}"
                elif self.exitcodes[rank] is None:
                    why = "an earlier case of this module failed on this rank"
                else:
                    why = f"the worker ended with exit code {self.exitcodes[rank]}"
                errors.append(f"rank {rank}: not run ({why})")
            elif not outcome["ok"]:
                errors.append(f"rank {rank}:\n{outcome['error']}")
        if errors:
            note = f"\n{self.note}" if self.note else ""
            pytest.fail(f"distributed case {name} failed:{note}\n" + "\n".join(errors),
                        pytrace=False)


@dataclass
class _Spawn:
    """The ranks of one world size and the groups they run, in order."""

    groups: list
    tmp: str
    procs: list = field(default_factory=list)
    asked: int = -1              # index of the last group the ranks were told to run

    def start(self) -> None:
        # The ranks fork from one server that imported torch and the cases' modules once,
        # instead of each rank importing them again (see _one_thread.py).
        ctx = mp.get_context("forkserver")
        # The packages the cases import inside their functions (transformers, Lightning: 4-6 s
        # each) too, where installed: else every rank would import them again.
        extra = sorted({m for g in self.groups for m in g.preload
                        if importlib.util.find_spec(m.partition(".")[0]) is not None})
        ctx.set_forkserver_preload(["_one_thread", "torch", "torch._dynamo", "moebalance", *extra,
                                    *sorted({c.__module__ for g in self.groups for c in g.cases}),
                                    "moebalance._fork_ready"])
        environ = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
        world_size = self.groups[0].world_size
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(rank, self.groups, self.tmp, environ))
                      for rank in range(world_size)]
        for p in self.procs:
            p.start()

    def _states(self) -> list:
        states = []
        for rank in range(len(self.procs)):
            path = os.path.join(self.tmp, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    states.append(json.load(f))
            else:
                states.append({"results": {}, "done": []})
        return states

    def results(self, name: str) -> DistResults:
        index = next(i for i, g in enumerate(self.groups) if g.name == name)
        group = self.groups[index]
        note = ""
        if index <= self.asked:
            note = f"group {name} was asked for after a later group had run"
        else:
            if not self.procs:
                self.start()
            self.asked = index
            open(os.path.join(self.tmp, f"go{index}"), "w").close()
            deadline = time.monotonic() + group.timeout_s
            while True:
                states = self._states()
                if all(name in s["done"] for s in states):
                    break
                if any(not p.is_alive() for p in self.procs):
                    note = "a worker died; the others were stopped"
                    break
                if time.monotonic() > deadline:
                    note = (f"group {name} ran past its {group.timeout_s:.0f} s: "
                            "the ranks were killed")
                    break
                time.sleep(0.05)
            if note:
                self.kill()
        states = self._states()
        return DistResults(group.world_size, [s["results"].get(name, {}) for s in states],
                           [p.exitcode for p in self.procs], note)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()

    def close(self) -> None:
        # Every group has run: the ranks only wait. They are told to stop and given a moment to
        # leave on their own; tearing down torch and gloo can take seconds on a busy machine.
        open(os.path.join(self.tmp, "stop"), "w").close()
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()


class SharedSpawns:
    """The session's spawns, one per world size, over the groups whose tests were selected."""

    def __init__(self, selected: list):
        self._tmp = tempfile.mkdtemp(prefix="moebalance-dist-")
        self._spawns: dict[int, _Spawn] = {}
        for world_size in sorted({_GROUPS[n].world_size for n in selected}):
            folder = os.path.join(self._tmp, f"world{world_size}")
            os.mkdir(folder)
            self._spawns[world_size] = _Spawn(
                [_GROUPS[n] for n in selected if _GROUPS[n].world_size == world_size], folder)

    def results(self, name: str) -> DistResults:
        return self._spawns[_GROUPS[name].world_size].results(name)

    def close(self) -> None:
        try:
            for spawn in self._spawns.values():
                spawn.close()
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)


def selected_groups(items) -> list:
    """Names of the registered groups with a selected test, in the order pytest runs them."""
    names = []
    for item in items:
        module = getattr(item, "module", None)
        name = getattr(module, "__name__", None)
        if name in _GROUPS and "dist_results" in getattr(item, "fixturenames", ()) \
                and name not in names:
            names.append(name)
    return names


def shared_spawn(cases: list, group: str, world_size: int = 4, timeout_s: float = 300.0,
                 collective_timeout_s: float = 30.0, quiet: bool = False, preload=(),
                 backend: str | None = "gloo"):
    """Register a test module's ``cases`` as group ``group`` (its ``__name__``) of the shared
    spawn and return the module-scoped ``dist_results`` fixture that gives their outcomes.

    Args:
        cases: module-level functions (picklable by reference), run in order on every rank.
        group: the registering module's ``__name__``.
        world_size: ranks; groups of one world size share one spawn.
        timeout_s: wall-clock limit for the group, counted from when its tests ask for it (the
            first group's includes starting the ranks); past it the ranks are killed.
        collective_timeout_s: gloo timeout, so a rank waiting on a failed peer gives up.
        quiet: the cases judge measured times: the suite's background commands pause while
            the group runs (see ``_launches.py``).
        preload: modules the cases import when they run (``"lightning"``), imported once by
            the ranks' server where their package is installed.
        backend: the process group's backend; None: none named, as ``init_process_group()``
            called bare (torchrun scripts often do).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    names = [case_id(c) for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"cases of group {group} must have distinct names, got {names}")
    _GROUPS[group] = Group(group, list(cases), world_size, float(timeout_s),
                           float(collective_timeout_s), tuple(preload), backend)

    @pytest.fixture(scope="module", name="dist_results")
    def dist_results(dist_spawns, background):
        with background.paused() if quiet else contextlib.nullcontext():
            return dist_spawns.results(group)

    return dist_results
