"""Shared test set-up: hypothesis profiles, a seeded generator and backend isolation.

Hypothesis profiles (choose with ``HYPOTHESIS_PROFILE=...``):
    ``ci`` (default): a fixed, modest set of examples, the same on every run, no deadline
    (the test machines are shared, so timings are noisy and JIT compiles land in examples).
    ``explore``: many fresh random examples, for hunting bugs locally.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import numpy as np
import pytest
from _dist import SharedSpawns, selected_groups
from _launches import TIMEOUT_S, Launches, launches_of
from hypothesis import HealthCheck, settings

# The package re-exports the function ``backends`` under the submodule's name, so attribute
# access (``moebalance.backends``) gives the function; the module is reached through importlib.
_backends = importlib.import_module("moebalance.backends")

settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "explore", max_examples=1000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def rng() -> np.random.Generator:
    """A numpy generator with a fixed seed, fresh for every test."""
    return np.random.default_rng(20240611)


@pytest.fixture
def isolated_backends(monkeypatch):
    """Leave backend selection as the test found it: forced choices, env vars and detection caches.

    Tests that force a backend, set ``MOEBALANCE_*`` variables or clear the detection caches use
    this so a failure mid-test cannot leak a forced backend into later tests.
    """
    for var in ("MOEBALANCE_PLANNER", "MOEBALANCE_DISPATCH", "MOEBALANCE_DISABLE_NUMBA"):
        monkeypatch.delenv(var, raising=False)
    forced = dict(_backends._forced)
    _backends._forced.clear()
    _backends.has_numba.cache_clear()
    _backends.has_cupy_gpu.cache_clear()
    yield _backends
    _backends._forced.clear()
    _backends._forced.update(forced)
    _backends.has_numba.cache_clear()
    _backends.has_cupy_gpu.cache_clear()


@pytest.fixture(scope="session")
def dist_spawns(request):
    """The gloo ranks every distributed test module shares (see ``_dist.py``)."""
    spawns = SharedSpawns(selected_groups(request.session.items))
    yield spawns
    spawns.close()


@pytest.fixture
def run_moebalance(capfd):
    """Run the ``moebalance`` command in this process; return (exit status, stdout, stderr).

    The ranks a benchmark spawns start as they would from the shell, and capfd sees their output
    too (``python -m moebalance`` itself is run by test_cli). Torch's thread count, which some
    benchmarks set for their timings, is restored afterwards.
    """
    import torch

    from moebalance.cli import main as cli

    def run(argv) -> tuple[int, str, str]:
        threads = torch.get_num_threads()
        try:
            rc = cli.main([str(a) for a in argv])
        finally:
            torch.set_num_threads(threads)
        out, err = capfd.readouterr()
        return rc, out, err

    return run


# -- commands run in the background (see ``_launches.py``) ----------------------------------------

_LAUNCHES: list[Launches] = []


def pytest_collection_modifyitems(session, config, items):
    """Run the tests that read background commands last, in the order their commands start."""
    def key(item):
        launches = launches_of(item)
        return (bool(launches), -max((launch.seconds for launch in launches), default=0.0))

    items.sort(key=key)
    for item in items:
        if launches_of(item):
            item.add_marker(pytest.mark.timeout(TIMEOUT_S + 60), append=False)


def pytest_collection_finish(session):
    """Start the selected tests' commands now, beside the rest of the suite."""
    if not session.config.option.collectonly and any(map(launches_of, session.items)):
        _LAUNCHES.append(Launches(session.items))


def pytest_sessionfinish(session):
    for launches in _LAUNCHES:
        launches.close()


class _NoLaunches:
    @staticmethod
    def paused():
        return contextlib.nullcontext()


@pytest.fixture(scope="session")
def background():
    """What runs in the background: ``background.paused()`` holds it for a ``with`` block."""
    return _LAUNCHES[0] if _LAUNCHES else _NoLaunches()


@pytest.fixture(scope="session")
def launches(request) -> Launches:
    """The background commands of the selected tests (started when collection ended)."""
    if not _LAUNCHES:
        _LAUNCHES.append(Launches(request.session.items))
    return _LAUNCHES[0]
