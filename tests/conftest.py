"""Shared test set-up: hypothesis profiles, a seeded generator and backend isolation.

Hypothesis profiles (choose with ``HYPOTHESIS_PROFILE=...``):
    ``ci`` (default): a fixed, modest set of examples, the same on every run, no deadline
    (the test machines are shared, so timings are noisy and JIT compiles land in examples).
    ``explore``: many fresh random examples, for hunting bugs locally.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
from _dist import SharedSpawns, selected_groups
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


# -- the examples: started in the background as the session starts, checked at its end -------------


def _module_name(item) -> str | None:
    module = getattr(item, "module", None)
    return module.__name__ if module is not None else None


def pytest_collection_modifyitems(session, config, items):
    """Run test_examples' tests last: their launches run beside everything before them."""
    items.sort(key=lambda item: _module_name(item) == "test_examples")


def pytest_collection_finish(session):
    """Start every selected example launch now, so that their ranks use the core the rest of
    the suite (mostly one process) leaves idle."""
    examples = [item for item in session.items if _module_name(item) == "test_examples"]
    if examples and not session.config.option.collectonly:
        examples[0].module.start_launches(session.items)


def pytest_sessionfinish(session):
    import sys

    module = sys.modules.get("test_examples")
    if module is not None:
        module.stop_launches()
