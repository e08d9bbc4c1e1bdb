"""The per-step re-split kernel: its Numba copy equals its plain-Python run, it reaches the LP
optimum of the slowest device's time, its sweeps equal the torch form's, its per-step loads form
is the same function, the backends agree, and (on a GPU) the CUDA form equals the Numba one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import placement_cases

import moebalance as mb
from moebalance.backends import has_cupy_gpu, using_backend
from moebalance.dispatch.routing import replica_table
from moebalance.dispatch.shares import (
    optimal_max_time,
    resplit_plan,
    resplit_shares,
    resplit_shares_torch,
)
from moebalance.planner import _jit
from moebalance.planner.core import MAX_SWEEPS, devices_of


def _counts(gen, num_experts: int, zeros: float = 0.3) -> np.ndarray:
    """Skewed integer counts with some experts at zero."""
    w = gen.poisson(gen.gamma(0.7, 300.0, size=num_experts)).astype(np.float64)
    w[gen.random(num_experts) < zeros] = 0.0
    if w.sum() == 0:
        w[0] = 1.0
    return w


def _planned_case(seed: int, num_devices: int = 16, slots: int = 4, num_experts: int = 40,
                  uneven: bool = True):
    """A placement from mb.plan on skewed loads, over devices of uneven speeds."""
    gen = np.random.default_rng(seed)
    speed = gen.choice([1.0, 0.5, 0.25], num_devices) if uneven else np.ones(num_devices)
    topo = mb.Topology.from_arrays(speed=speed, slots=[slots] * num_devices)
    placement = mb.plan(gen.gamma(0.7, 100.0, size=(1, num_experts)), topo)
    return gen, topo, placement


def _run(k, w, plan, share_EX, sweeps: int, exact: bool):
    share = share_EX.numpy().copy()
    load = np.empty(plan.speed_G.shape[0])
    k.resplit_layer(w, plan.device_EX.numpy(), plan.speed_G.numpy(), plan.order_V.numpy(), share,
                    load, sweeps, exact)
    return share, load


def _assert_valid(share, start, device_EX, w):
    valid = device_EX >= 0
    assert np.all(share >= 0) and np.all(share[~valid] == 0)
    np.testing.assert_allclose(share.sum(axis=1), 1.0, rtol=1e-12)
    fixed = (valid.sum(axis=1) == 1) | (w == 0)
    np.testing.assert_array_equal(share[fixed], start[fixed])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("exact", [False, True])
def test_compiled_kernel_equals_its_plain_python_run(seed, exact):
    gen, topo, placement = _planned_case(seed)
    table = replica_table(placement, 0)
    plan = resplit_plan(table, topo.speed)
    for _ in range(3):
        w = _counts(gen, placement.num_experts)
        fast = _run(_jit.kernels("numba"), w, plan, table.share_EX, 2, exact)
        slow = _run(_jit.kernels("numpy"), w, plan, table.share_EX, 2, exact)
        np.testing.assert_array_equal(fast[0], slow[0])
        np.testing.assert_array_equal(fast[1], slow[1])


@settings(max_examples=60, deadline=None)
@given(placement_cases(max_devices=8, max_slots=4, max_layers=1), st.integers(0, 10**6),
       st.integers(0, 3))
def test_exact_resplit_reaches_the_lp_optimum_with_valid_shares(case, seed, sweeps):
    p, topo = case.placement, case.topology
    gen = np.random.default_rng(seed)
    w = _counts(gen, p.num_experts)
    table = replica_table(p, 0)
    plan = resplit_plan(table, topo.speed)
    share, load = _run(_jit.kernels("numba"), w, plan, table.share_EX, sweeps, True)
    best = optimal_max_time(w, p.phy2log[0], p.slot_device, topo.speed)
    assert np.max(load / topo.speed) == pytest.approx(best, rel=1e-7, abs=1e-9)
    device_EX = plan.device_EX.numpy()
    _assert_valid(share, table.share_EX.numpy(), device_EX, w)
    # load is what the shares put on each device
    expect = np.zeros(topo.num_devices)
    np.add.at(expect, device_EX[device_EX >= 0], (w[:, None] * share)[device_EX >= 0])
    np.testing.assert_allclose(load, expect, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_exact_resplit_reaches_the_lp_optimum_on_large_planned_layers(seed):
    gen, topo, placement = _planned_case(100 + seed, num_devices=64, slots=8, num_experts=256,
                                         uneven=seed % 2 == 1)
    table = replica_table(placement, 0)
    plan = resplit_plan(table, topo.speed)
    for _ in range(2):
        w = _counts(gen, placement.num_experts, zeros=0.05)
        share, load = _run(_jit.kernels("numba"), w, plan, table.share_EX, 2, True)
        best = optimal_max_time(w, placement.phy2log[0], placement.slot_device, topo.speed)
        ideal = w.sum() / topo.speed.sum()
        assert abs(np.max(load / topo.speed) - best) <= 1e-6 * ideal
        _assert_valid(share, table.share_EX.numpy(), plan.device_EX.numpy(), w)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("sweeps", [1, 4])
def test_kernel_sweeps_equal_the_torch_form(seed, sweeps):
    gen, topo, placement = _planned_case(200 + seed)
    table = replica_table(placement, 0)
    plan = resplit_plan(table, topo.speed)
    w = _counts(gen, placement.num_experts)
    share, _ = _run(_jit.kernels("numba"), w, plan, table.share_EX, sweeps, False)
    reference = resplit_shares_torch(torch.from_numpy(w), table.share_EX, plan, sweeps=sweeps)
    np.testing.assert_allclose(share, reference.numpy(), rtol=1e-9, atol=1e-12)


def test_one_replica_everywhere_changes_nothing():
    topo = mb.Topology.from_arrays(speed=[1.0, 0.5, 2.0], slots=[2, 2, 2])
    placement = mb.plan(np.array([[5.0, 1.0, 3.0, 2.0, 4.0, 6.0]]), topo)
    assert placement.replicas.max() == 1
    table = replica_table(placement, 0)
    plan = resplit_plan(table, topo.speed)
    w = np.array([10.0, 0.0, 3.0, 7.0, 1.0, 2.0])
    share, load = _run(_jit.kernels("numba"), w, plan, table.share_EX, 2, True)
    np.testing.assert_array_equal(share, table.share_EX.numpy())
    expect = np.zeros(3)
    np.add.at(expect, placement.slot_device, w[placement.phy2log[0]])
    np.testing.assert_allclose(load, expect)


def test_per_step_loads_form_equals_the_layer_form_and_beats_the_planner_sweeps():
    gen, topo, placement = _planned_case(7, num_devices=8, slots=5, num_experts=24)
    counts_TE = np.stack([_counts(gen, 24) for _ in range(12)])
    args = (placement.phy2log[0], placement.share[0], topo.speed, placement.slot_device)
    fast = _jit.kernels("numba").resplit_loads(counts_TE, *args, 2, True)
    slow = _jit.kernels("numpy").resplit_loads(counts_TE, *args, 2, True)
    np.testing.assert_array_equal(fast, slow)
    np.testing.assert_allclose(fast.sum(axis=1), counts_TE.sum(axis=1))
    planner = _jit.kernels("numba").resplit_device_loads(counts_TE, devices_of(topo),
                                                         *args[:2], MAX_SWEEPS)
    table = replica_table(placement, 0)
    plan = resplit_plan(table, topo.speed)
    for t in range(counts_TE.shape[0]):
        _, load = _run(_jit.kernels("numba"), counts_TE[t], plan, table.share_EX, 2, True)
        np.testing.assert_allclose(fast[t], load, rtol=1e-12, atol=1e-9)
        assert (fast[t] / topo.speed).max() <= (planner[t] / topo.speed).max() * (1 + 1e-9)


def test_each_backend_runs_its_form():
    gen, topo, placement = _planned_case(11)
    table = replica_table(placement, 0)
    plan = resplit_plan(table, topo.speed)
    w = _counts(gen, placement.num_experts)
    with using_backend("resplit", "torch"):
        torch_form = resplit_shares(torch.from_numpy(w), table.share_EX, plan)
    np.testing.assert_array_equal(
        torch_form.numpy(), resplit_shares_torch(torch.from_numpy(w), table.share_EX, plan).numpy())
    with using_backend("resplit", "numba"):
        numba_form = resplit_shares(torch.from_numpy(w), table.share_EX, plan)
    np.testing.assert_array_equal(numba_form.numpy(),
                                  _run(_jit.kernels("numba"), w, plan, table.share_EX, 2, True)[0])
    assert mb.backends()["resplit.cpu"] in ("numba", "torch")


def test_bad_sweeps_raise_naming_them():
    _, topo, placement = _planned_case(3)
    table = replica_table(placement, 0)
    plan = resplit_plan(table, topo.speed)
    with pytest.raises(ValueError, match="sweeps"):
        resplit_shares(torch.ones(placement.num_experts), table.share_EX, plan, sweeps=-1)


@pytest.mark.skipif(not has_cupy_gpu() or not torch.cuda.is_available(),
                    reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("exact", [False, True])
def test_cuda_form_equals_the_numba_kernel(seed, exact):
    from moebalance.dispatch.resplit_cuda import resplit_shares_cuda

    gen, topo, placement = _planned_case(300 + seed, num_devices=64, slots=8, num_experts=256,
                                         uneven=seed % 2 == 1)
    table = replica_table(placement, 0)
    plan = resplit_plan(table, topo.speed)
    plan_gpu = resplit_plan(table.to("cuda"), topo.speed, device="cuda")
    for _ in range(3):
        w = _counts(gen, placement.num_experts, zeros=0.1)
        cpu, _ = _run(_jit.kernels("numba"), w, plan, table.share_EX, 2, exact)
        gpu = resplit_shares_cuda(torch.from_numpy(w).cuda(), table.share_EX.cuda(), plan_gpu,
                                  sweeps=2, exact=exact)
        np.testing.assert_allclose(gpu.cpu().numpy(), cpu, rtol=1e-9, atol=1e-12)
