"""Backend selection: automatic choice, forcing, environment overrides and bad names."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import numpy as np
import pytest

import moebalance as mb
from moebalance.backends import has_numba

# Every test here starts from a clean selection state and leaves it as it found it.
pytestmark = pytest.mark.usefixtures("isolated_backends")

KEYS = {"planner", "dispatch.cpu", "dispatch.cuda", "resplit.cpu", "resplit.cuda", "numba",
        "cupy_gpu"}


def fake_cupy(monkeypatch, is_available):
    """Install a stand-in ``cupy`` module whose ``cuda.is_available`` is ``is_available``."""
    module = types.ModuleType("cupy")
    module.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    module.cuda = types.SimpleNamespace(is_available=is_available)
    monkeypatch.setitem(sys.modules, "cupy", module)


def raise_runtime_error():
    raise RuntimeError("CUDA driver version is insufficient")


# -- automatic choice ------------------------------------------------------------------------------

def test_backends_reports_every_part_and_the_detected_accelerators(isolated_backends):
    report = mb.backends()
    assert set(report) == KEYS
    assert report["planner"] in isolated_backends.PLANNER_BACKENDS
    assert report["dispatch.cpu"] in isolated_backends.DISPATCH_BACKENDS
    assert report["dispatch.cuda"] in isolated_backends.DISPATCH_BACKENDS
    assert type(report["numba"]) is bool and type(report["cupy_gpu"]) is bool


def test_automatic_choice_follows_what_is_installed(isolated_backends):
    numba = isolated_backends.has_numba()
    report = mb.backends()
    assert report["numba"] is numba
    assert report["planner"] == ("numba" if numba else "numpy")
    assert report["dispatch.cpu"] == ("numba" if numba else "torch")
    assert report["dispatch.cuda"] == ("cuda" if report["cupy_gpu"] else "torch")


def test_disabling_numba_falls_back_to_numpy_and_torch(isolated_backends, monkeypatch):
    monkeypatch.setenv("MOEBALANCE_DISABLE_NUMBA", "1")
    isolated_backends.has_numba.cache_clear()
    report = mb.backends()
    assert report["numba"] is False
    assert report["planner"] == "numpy" and report["dispatch.cpu"] == "torch"


def test_cupy_with_a_gpu_selects_the_cuda_dispatch(isolated_backends, monkeypatch):
    fake_cupy(monkeypatch, lambda: True)
    isolated_backends.has_cupy_gpu.cache_clear()
    assert mb.backends()["cupy_gpu"] is True
    assert isolated_backends.backend("dispatch", "cuda") == "cuda"
    assert isolated_backends.backend("dispatch", "cpu") != "cuda"


@pytest.mark.parametrize("is_available", [lambda: False, raise_runtime_error])
def test_cupy_without_a_working_gpu_falls_back_to_torch(isolated_backends, monkeypatch,
                                                        is_available):
    fake_cupy(monkeypatch, is_available)
    isolated_backends.has_cupy_gpu.cache_clear()
    assert isolated_backends.has_cupy_gpu() is False
    assert isolated_backends.backend("dispatch", "cuda") == "torch"


# -- forcing ---------------------------------------------------------------------------------------

def test_force_backend_overrides_and_none_restores_the_automatic_choice(isolated_backends):
    auto = mb.backends()
    mb.force_backend("planner", "numpy")
    mb.force_backend("dispatch", "torch")
    report = mb.backends()
    assert report["planner"] == "numpy"
    assert report["dispatch.cpu"] == report["dispatch.cuda"] == "torch"
    mb.force_backend("planner", None)
    mb.force_backend("dispatch", None)
    assert mb.backends() == auto


def test_using_backend_restores_the_automatic_choice_on_exit():
    auto = mb.backends()
    with mb.using_backend("planner", "numpy"):
        assert mb.backends()["planner"] == "numpy"
    assert mb.backends() == auto


def test_using_backend_restores_even_when_the_body_raises():
    auto = mb.backends()
    with pytest.raises(KeyError):
        with mb.using_backend("dispatch", "torch"):
            assert mb.backends()["dispatch.cpu"] == "torch"
            raise KeyError("boom")
    assert mb.backends() == auto


def test_nested_using_backend_restores_the_outer_choice():
    with mb.using_backend("planner", "numpy"):
        with mb.using_backend("planner", "numba"):
            assert mb.backends()["planner"] == "numba"
        assert mb.backends()["planner"] == "numpy"


def test_using_backend_restores_a_previously_forced_backend():
    mb.force_backend("dispatch", "torch")
    with mb.using_backend("dispatch", "numba"):
        assert mb.backends()["dispatch.cpu"] == "numba"
    assert mb.backends()["dispatch.cpu"] == "torch"


def test_forcing_one_part_leaves_the_other_alone():
    auto = mb.backends()
    with mb.using_backend("planner", "numpy"):
        report = mb.backends()
        assert report["dispatch.cpu"] == auto["dispatch.cpu"]
        assert report["dispatch.cuda"] == auto["dispatch.cuda"]


# -- environment variables -------------------------------------------------------------------------

def test_environment_variables_override_the_automatic_choice(monkeypatch):
    monkeypatch.setenv("MOEBALANCE_PLANNER", "numpy")
    monkeypatch.setenv("MOEBALANCE_DISPATCH", "torch")
    report = mb.backends()
    assert report["planner"] == "numpy"
    assert report["dispatch.cpu"] == report["dispatch.cuda"] == "torch"


def test_an_empty_environment_variable_means_automatic(monkeypatch):
    auto = mb.backends()
    monkeypatch.setenv("MOEBALANCE_PLANNER", "")
    assert mb.backends() == auto


def test_forcing_in_code_beats_the_environment(monkeypatch):
    monkeypatch.setenv("MOEBALANCE_PLANNER", "numpy")
    with mb.using_backend("planner", "numba"):
        assert mb.backends()["planner"] == "numba"
    assert mb.backends()["planner"] == "numpy"


def test_an_unknown_backend_in_the_environment_raises(monkeypatch):
    monkeypatch.setenv("MOEBALANCE_PLANNER", "cuda")
    with pytest.raises(ValueError, match=r"'cuda'.*one of \['numba', 'numpy'\]|"
                                         r"one of \['numba', 'numpy'\].*'cuda'"):
        mb.backends()


def test_an_unknown_backend_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("MOEBALANCE_PLANNER", "cuda")
    with pytest.raises(ValueError, match=r"MOEBALANCE_PLANNER"):
        mb.backends()


# -- invalid names ---------------------------------------------------------------------------------

@pytest.mark.parametrize("part, name, message", [
    ("planner", "cuda", r"planner backend must be one of"),
    ("planner", "Numba", r"planner backend must be one of"),
    ("dispatch", "numpy", r"dispatch backend must be one of"),
    ("dispatch", "", r"dispatch backend must be one of"),
    ("router", "numpy", r"part must be one of \['dispatch', 'planner', 'resplit'\]"),
])
def test_invalid_names_raise_value_error_and_change_nothing(isolated_backends, part, name, message):
    auto = mb.backends()
    with pytest.raises(ValueError, match=message):
        mb.force_backend(part, name)
    with pytest.raises(ValueError, match=message):
        with mb.using_backend(part, name):
            pass  # pragma: no cover - never entered
    assert mb.backends() == auto
    assert isolated_backends._forced == {}


def test_backend_of_an_unknown_part_raises(isolated_backends):
    with pytest.raises(ValueError, match=r"part must be one of"):
        isolated_backends.backend("router")


def test_restoring_an_unknown_part_raises_value_error():
    with pytest.raises(ValueError, match=r"part must be one of"):
        mb.force_backend("router", None)


def test_warm_up_compiles_every_part():
    import moebalance as mb

    started = []
    spent = mb.warm_up(progress=started.append)
    if mb.backends()["numba"]:
        assert set(spent) == {"planner", "rebalance_experts", "dispatch"}
        assert started == list(spent)  # each part announced as it starts, in order
        assert all(seconds >= 0 for seconds in spent.values())
    else:
        assert spent == {}


@pytest.mark.skipif(not has_numba(), reason="needs Numba")
def test_after_warm_up_a_rebalancers_replan_compiles_nothing():
    """The Rebalancer's calls (a window of per-step counts, planned against the placement in
    force, whose arrays are read-only, and judged per step) find every kernel compiled: each
    rank of a job would otherwise compile them at its first re-plan."""
    import moebalance as mb
    from moebalance.planner import _jit

    def specialisations() -> int:     # compiled now or loaded from the on-disk cache
        return sum(len(k.signatures) for k in vars(_jit.kernels("numba")).values())

    mb.warm_up(parts=["planner"])
    topology = mb.Topology.from_arrays([1.0, 1.0, 0.5, 0.5], [3, 3, 3, 3], [0, 0, 1, 1])
    window = np.random.default_rng(0).integers(0, 50, (6, 2, 8)).astype(np.float64)
    before = specialisations()
    in_force = mb.plan(window, topology, backend="numba")
    mb.plan(window[::-1].copy(), topology, previous=in_force, max_moves=2, backend="numba")
    mb.step_imbalance(window, in_force, topology, backend="numba")
    assert specialisations() == before


@pytest.mark.skipif(not has_numba(), reason="needs Numba")
def test_after_warm_up_a_layers_transient_copies_compile_nothing():
    """A layer built with transient=K chooses its copies at each step with the dispatcher's
    host arrays: after warm_up its first step finds the rule compiled."""
    import moebalance as mb
    from moebalance.dispatch.routing import replica_table
    from moebalance.dispatch.transient import TransientRouting
    from moebalance.planner import _jit

    def specialisations() -> int:
        return sum(len(k.signatures) for k in vars(_jit.kernels("numba")).values())

    mb.warm_up(parts=["dispatch"])
    topology = mb.Topology.from_arrays([1.0, 1.0, 0.5], [2, 2, 3], [0, 0, 1])
    table = replica_table(mb.plan(np.ones((1, 6)), topology), 0)
    routing = TransientRouting(table.slots_EX.numpy(), table.device_EX.numpy(),
                               table.share_EX.numpy(), np.array([0, 2, 4, 7]), 2,
                               topology.speed, topology.node, 0.5)
    before = specialisations()
    step, *_ = routing.choose(np.array([[90, 1, 1, 1, 1, 1]] * 3, dtype=np.int64))
    assert step is not None and step.num_copies >= 1        # the rule ran through to a copy
    assert specialisations() == before


def test_warm_up_of_some_parts_leaves_the_others_and_names_a_bad_part():
    import moebalance as mb

    spent = mb.warm_up(parts=["planner"])
    assert set(spent) == ({"planner"} if mb.backends()["numba"] else set())
    with pytest.raises(ValueError, match=r"parts must be among .*'router'"):
        mb.warm_up(parts=["planner", "router"])
