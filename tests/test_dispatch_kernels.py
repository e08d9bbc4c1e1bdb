"""Dispatch kernels: the Numba and CUDA kernels reproduce the torch reference exactly (integers,
gathers and combines) or to rounding (dot products), on random inputs with fixed seeds."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from moebalance import Placement
from moebalance.backends import has_cupy_gpu
from moebalance.dispatch import numba_kernels, reference
from moebalance.dispatch.routing import replica_flows, replica_table

# (T tokens, K top-k, E experts, S slots, D hidden): T=0, K=1..8, odd sizes, more slots than used.
SHAPES = [(0, 2, 4, 6, 8), (1, 1, 3, 3, 5), (37, 8, 16, 24, 33), (200, 4, 8, 12, 64),
          (64, 3, 5, 20, 16), (513, 6, 32, 40, 7),
          # past numba_kernels._SERIAL_BELOW pairs: the multi-threaded path of every kernel
          (4500, 8, 16, 24, 4)]
FLOATS = [torch.float32, torch.float64]


def _placement(gen: np.random.Generator, E: int, S: int) -> Placement:
    """S >= E slots on ranks of 2..min(4, E) slots; every expert has a replica; some shares are
    0."""
    sizes = []
    while sum(sizes) < S:
        sizes.append(int(min(gen.integers(2, min(4, E) + 1), S - sum(sizes))))
    device = np.repeat(np.arange(len(sizes)), sizes)
    # Every expert gets one slot; each device fills its other slots with experts it lacks.
    phy2log = np.full(S, -1, dtype=np.int64)
    phy2log[gen.permutation(S)[:E]] = np.arange(E)
    for g in range(len(sizes)):
        own = np.flatnonzero(device == g)
        free = own[phy2log[own] < 0]
        lacking = np.setdiff1d(np.arange(E), phy2log[own])
        phy2log[free] = gen.permutation(lacking)[:free.size]
    weight = gen.integers(0, 4, S).astype(np.float64)
    total = np.bincount(phy2log, weights=weight, minlength=E)
    weight = np.where(total[phy2log] > 0, weight, 1.0)
    share = weight / np.bincount(phy2log, weights=weight, minlength=E)[phy2log]
    return Placement(phy2log[None], share[None], device, E).validate()


def _route_args(placement: Placement, ids: torch.Tensor, gen: np.random.Generator) -> tuple:
    """(rank_TK, slots_EX, bounds_EX) routing ``ids`` from a random rank of ``placement`` whose
    other ranks hold random counts: what the Dispatcher passes to ``route``."""
    G, E = placement.num_devices, placement.num_experts
    rank = int(gen.integers(G))
    table = replica_table(placement, 0)
    counts = torch.from_numpy(gen.integers(0, 50, (G, E)))
    _, place, counts[rank] = reference.sort_by_slot(ids, E)
    flow = replica_flows(counts, table.share_EX, table.device_EX)
    rank_TK = place - (torch.cumsum(counts[rank], 0) - counts[rank])[ids]
    return rank_TK, table.slots_EX, torch.cumsum(flow[rank], dim=1)


def _case(shape, seed: int, dtype=torch.float32):
    """Random routed inputs: ids (experts 0 and 1 get no tokens when E > 3), the route arguments
    (rank_TK, slots_EX, bounds_EX), rows, weights."""
    T, K, E, S, D = shape
    gen = np.random.default_rng(seed)
    torch.manual_seed(seed)
    placement = _placement(gen, E, S)
    low = 2 if E > 3 else 0
    rows = [gen.choice(np.arange(low, E), size=K, replace=K > E - low) for _ in range(T)]
    ids = torch.from_numpy(np.array(rows, dtype=np.int64).reshape(T, K))
    x = torch.randn(T, D, dtype=dtype)
    w = torch.rand(T, K, dtype=dtype)
    return ids, _route_args(placement, ids, gen), x, w


def _sorted(shape, seed, dtype=torch.float32):
    ids, route_args, x, w = _case(shape, seed, dtype)
    slot = reference.route(ids, *route_args)
    order, pos, counts = reference.sort_by_slot(slot, shape[3])
    return slot, order, pos, counts, x, w


# -- Numba vs reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_numba_route_equals_reference(shape, seed):
    ids, route_args, _, _ = _case(shape, seed=seed)
    assert torch.equal(numba_kernels.route(ids, *route_args), reference.route(ids, *route_args))


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_route_sends_each_replica_its_flow_in_pair_order(shape):
    ids, (rank_TK, slots_EX, bounds_EX), _, _ = _case(shape, seed=12)
    slot = reference.route(ids, rank_TK, slots_EX, bounds_EX)
    flow_EX = torch.diff(bounds_EX, dim=1, prepend=torch.zeros_like(bounds_EX[:, :1]))
    got = torch.bincount(slot.reshape(-1), minlength=shape[3])
    valid = slots_EX >= 0
    want = torch.zeros(shape[3], dtype=torch.int64)
    want[slots_EX[valid]] = flow_EX[valid]
    assert torch.equal(got, want)
    # within one expert, a replica's pairs are a contiguous run of the expert's pairs
    for e in range(slots_EX.shape[0]):
        picked = slot.reshape(-1)[ids.reshape(-1) == e]
        column = {int(s): j for j, s in enumerate(slots_EX[e].tolist()) if s >= 0}
        js = [column[int(s)] for s in picked]
        assert js == sorted(js)


@pytest.mark.parametrize("shape", SHAPES)
def test_numba_sort_by_slot_equals_reference(shape):
    slot, *expected = _sorted(shape, seed=2)
    for got, want in zip(numba_kernels.sort_by_slot(slot, shape[3]), expected):
        assert got.dtype == torch.int64 and torch.equal(got, want)


@pytest.mark.parametrize("num_chunks", [1, 2, 7, 64])
def test_counting_sort_is_stable_for_any_chunk_count(num_chunks):
    gen = np.random.default_rng(num_chunks)
    slot = gen.integers(0, 9, 5000).astype(np.int64)
    slot[slot == 4] = 3  # slot 4 gets no pairs
    order, pos, counts = (np.empty(5000, np.int64), np.empty(5000, np.int64), np.empty(9, np.int64))
    numba_kernels._sort_kernel(slot, 9, num_chunks, order, pos, counts)
    np.testing.assert_array_equal(order, np.argsort(slot, kind="stable"))
    np.testing.assert_array_equal(order[pos], np.arange(5000))
    np.testing.assert_array_equal(counts, np.bincount(slot, minlength=9))


def test_numba_sort_by_slot_equals_reference_on_many_chunks():
    slot = torch.from_numpy(np.random.default_rng(3).integers(0, 50, (20000, 8)))
    for got, want in zip(numba_kernels.sort_by_slot(slot, 50), reference.sort_by_slot(slot, 50)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("scaled", [False, True])
def test_numba_gather_rows_equals_reference(shape, dtype, scaled):
    _, order, _, _, x, w = _sorted(shape, seed=4, dtype=dtype)
    index = order // shape[1]
    scale = w.reshape(-1)[order] if scaled else None
    assert torch.equal(numba_kernels.gather_rows(x, index, scale),
                       reference.gather_rows(x, index, scale))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("weighted", [False, True])
def test_numba_combine_equals_reference(shape, dtype, weighted):
    _, order, pos, _, x, w = _sorted(shape, seed=5, dtype=dtype)
    y = torch.randn(order.numel(), shape[4], dtype=dtype)
    weights = w if weighted else None
    assert torch.equal(numba_kernels.combine(y, pos, weights), reference.combine(y, pos, weights))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_numba_combine_weight_grad_matches_reference(shape, dtype):
    _, order, pos, _, x, _ = _sorted(shape, seed=6, dtype=dtype)
    y = torch.randn(order.numel(), shape[4], dtype=dtype)
    got = numba_kernels.combine_weight_grad(x, y, pos)
    want = reference.combine_weight_grad(x, y, pos)
    assert got.dtype == want.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_numba_16bit_inputs_give_reference_results(dtype):
    shape = SHAPES[2]
    _, order, pos, _, x, w = _sorted(shape, seed=7, dtype=dtype)
    index = order // shape[1]
    y = reference.gather_rows(x, index)
    assert torch.equal(numba_kernels.gather_rows(x, index, w.reshape(-1)[order]),
                       reference.gather_rows(x, index, w.reshape(-1)[order]))
    assert torch.equal(numba_kernels.combine(y, pos, w.float()),
                       reference.combine(y, pos, w.float()))
    assert torch.equal(numba_kernels.combine_weight_grad(x, y, pos),
                       reference.combine_weight_grad(x, y, pos))


@pytest.mark.parametrize("kernels", [reference, numba_kernels], ids=["torch", "numba"])
def test_out_argument_is_filled_in_place(kernels):
    shape = SHAPES[3]
    _, order, pos, _, x, w = _sorted(shape, seed=8)
    index = order // shape[1]
    out = torch.empty(index.numel(), shape[4])
    assert kernels.gather_rows(x, index, out=out) is out
    assert torch.equal(out, reference.gather_rows(x, index))
    back = torch.empty_like(x)
    assert kernels.combine(out, pos, w, out=back) is back
    assert torch.equal(back, reference.combine(out, pos, w))


@pytest.mark.parametrize("kernels", [reference, numba_kernels], ids=["torch", "numba"])
def test_permute_then_combine_restores_weighted_tokens(kernels):
    shape = SHAPES[3]
    T, K = shape[:2]
    _, order, pos, _, x, w = _sorted(shape, seed=9, dtype=torch.float64)
    y = kernels.gather_rows(x, order // K)
    torch.testing.assert_close(kernels.combine(y, pos, w), x * w.sum(1, keepdim=True))
    torch.testing.assert_close(kernels.combine(y, pos), x * K)


def test_numba_kernels_run_as_plain_python(monkeypatch):
    """The kernels' Python bodies (what Numba compiles) compute the reference too."""
    for name in ("_route_kernel", "_sort_kernel", "_gather_kernel", "_gather_scaled_kernel",
                 "_combine_kernel", "_combine_weighted_kernel", "_weight_grad_kernel"):
        monkeypatch.setattr(numba_kernels, name, getattr(numba_kernels, name).py_func)
    shape = (9, 3, 5, 8, 4)
    ids, route_args, x, w = _case(shape, seed=10, dtype=torch.float64)
    args = (ids, *route_args)
    slot = numba_kernels.route(*args)
    assert torch.equal(slot, reference.route(*args))
    sorted_ = numba_kernels.sort_by_slot(slot, shape[3])
    for got, want in zip(sorted_, reference.sort_by_slot(slot, shape[3])):
        assert torch.equal(got, want)
    order, pos, _ = sorted_
    scale = w.reshape(-1)[order]
    assert torch.equal(numba_kernels.gather_rows(x, order // 3),
                       reference.gather_rows(x, order // 3))
    y = numba_kernels.gather_rows(x, order // 3, scale)
    assert torch.equal(y, reference.gather_rows(x, order // 3, scale))
    assert torch.equal(numba_kernels.combine(y, pos), reference.combine(y, pos))
    assert torch.equal(numba_kernels.combine(y, pos, w), reference.combine(y, pos, w))
    torch.testing.assert_close(numba_kernels.combine_weight_grad(x, y, pos),
                               reference.combine_weight_grad(x, y, pos))


_THREADS_AFTER_FIRST_KERNEL = """
import torch
from moebalance.dispatch import numba_kernels

ids = torch.tensor([[0, 1], [1, 0]])
numba_kernels.sort_by_slot(ids, 2)      # the dispatcher's first kernel, then the others
slots, bounds = torch.tensor([[0], [1]]), torch.tensor([[2], [2]])
numba_kernels.route(ids, torch.zeros_like(ids), slots, bounds)
print(torch.get_num_threads())
"""


def test_first_kernel_leaves_torch_thread_count_alone():
    """torchrun holds each rank to one thread (OMP_NUM_THREADS=1). Numba's OpenMP pool, started
    by the first thread query or parallel kernel, set torch's count to its own (every core)
    before; it is kept."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", _THREADS_AFTER_FIRST_KERNEL], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1"]


# -- backend choice ----------------------------------------------------------------------------


@pytest.mark.parametrize("forced, cpu, cuda_", [
    ("torch", "reference", "reference"),
    ("numba", "numba_kernels", "reference"),
    ("cuda", "numba_kernels", "cuda"),  # CPU tensors keep the automatic choice
])
def test_kernels_for_runs_a_forced_backend_only_where_it_can(isolated_backends, forced, cpu, cuda_):
    from moebalance.dispatch.kernels import kernels_for

    isolated_backends.force_backend("dispatch", forced)
    assert kernels_for("cpu").__name__.rsplit(".", 1)[1] == cpu
    assert kernels_for("cuda").__name__.rsplit(".", 1)[1] == cuda_


def test_kernels_for_rejects_unknown_device_types():
    from moebalance.dispatch.kernels import kernels_for

    with pytest.raises(ValueError, match="device_type"):
        kernels_for("mps")


# -- argument checks --------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", [reference, numba_kernels], ids=["torch", "numba"])
def test_bad_arguments_raise_errors_naming_the_argument(kernels):
    ids = torch.zeros(4, 2, dtype=torch.int64)
    slots = torch.zeros(3, 2, dtype=torch.int64)
    bounds = torch.full((3, 2), 4)
    rank = torch.zeros(4, 2, dtype=torch.int64)
    x = torch.randn(4, 8)
    pos = torch.arange(8).view(4, 2)
    with pytest.raises(TypeError, match="topk_ids_TK"):
        kernels.route(ids.int(), rank, slots, bounds)
    with pytest.raises(ValueError, match="bounds_EX"):
        kernels.route(ids, rank, slots, bounds[:, :1])
    with pytest.raises(ValueError, match="rank_TK"):
        kernels.route(ids, rank[:, :1], slots, bounds)
    with pytest.raises(ValueError, match="topk_ids_TK"):
        kernels.route(ids + 3, rank, slots, bounds)
    with pytest.raises(ValueError, match="slot_TK"):
        kernels.sort_by_slot(ids + 5, 5)
    with pytest.raises(ValueError, match="num_slots"):
        kernels.sort_by_slot(ids, 0)
    with pytest.raises(ValueError, match="index_N"):
        kernels.gather_rows(x, torch.tensor([0, 4]))
    with pytest.raises(TypeError, match="x_MD"):
        kernels.gather_rows(x.long(), torch.tensor([0]))
    with pytest.raises(ValueError, match="scale_N"):
        kernels.gather_rows(x, torch.tensor([0, 1]), torch.ones(3))
    with pytest.raises(ValueError, match="out"):
        kernels.gather_rows(x, torch.tensor([0, 1]), out=torch.empty(3, 8))
    with pytest.raises(ValueError, match="pos_TK"):
        kernels.combine(x, pos)
    with pytest.raises(ValueError, match="weights_TK"):
        kernels.combine(torch.randn(8, 8), pos, torch.ones(4, 3))
    with pytest.raises(TypeError, match="grad_TD"):
        kernels.combine_weight_grad(x.double(), torch.randn(8, 8), pos)
    with pytest.raises(ValueError, match="grad_TD"):
        kernels.combine_weight_grad(torch.randn(3, 8), torch.randn(8, 8), pos)


def test_cuda_kernels_without_a_gpu_raise_runtime_error():
    if has_cupy_gpu():
        pytest.skip("a CUDA GPU is present")
    from moebalance.dispatch import cuda

    with pytest.raises(RuntimeError, match="CUDA"):
        cuda.gather_rows(torch.randn(2, 2), torch.tensor([0]))


# -- CUDA vs reference ----------------------------------------------------------------------------

gpu = pytest.mark.skipif(not has_cupy_gpu(), reason="needs CuPy and a CUDA GPU")
ALL_FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
GPU_SHAPES = SHAPES + [(4096, 8, 64, 96, 1024), (300, 2, 4, 4, 7168)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", ALL_FLOATS)
def test_cuda_kernels_equal_reference(shape, dtype):
    from moebalance.dispatch import cuda

    T, K, E, S, D = shape
    ids, route_args, x, w = _case(shape, seed=11, dtype=dtype)
    ids, x, w = ids.cuda(), x.cuda(), w.cuda()
    args = (ids, *(a.cuda() for a in route_args))
    slot = cuda.route(*args)
    assert torch.equal(slot, reference.route(*args))
    sorted_ = cuda.sort_by_slot(slot, S)
    for got, want in zip(sorted_, reference.sort_by_slot(slot, S)):
        assert torch.equal(got, want)
    order, pos, _ = sorted_
    index = order // K
    assert torch.equal(cuda.gather_rows(x, index), reference.gather_rows(x, index))
    scale = w.reshape(-1)[order]
    assert torch.equal(cuda.gather_rows(x, index, scale), reference.gather_rows(x, index, scale))
    y = torch.randn(T * K, D, device="cuda").to(dtype)
    assert torch.equal(cuda.combine(y, pos), reference.combine(y, pos))
    assert torch.equal(cuda.combine(y, pos, w), reference.combine(y, pos, w))
    tol = {torch.float64: 1e-12}.get(dtype, 1e-4)
    torch.testing.assert_close(cuda.combine_weight_grad(x, y, pos),
                               reference.combine_weight_grad(x, y, pos), rtol=tol, atol=tol * D)


@pytest.mark.gpu
@gpu
def test_cuda_gather_rows_handles_unaligned_rows():
    from moebalance.dispatch import cuda

    base = torch.randn(1000, 13, device="cuda")
    x = base[:, 1:]  # rows of 48 bytes starting 4 bytes in: 4-byte words only after .contiguous()
    index = torch.randint(0, 1000, (777,), device="cuda")
    assert torch.equal(cuda.gather_rows(x, index), reference.gather_rows(x, index))
    half = torch.randn(50, 3, device="cuda").half()  # 6-byte rows: 2-byte words
    idx = torch.randint(0, 50, (40,), device="cuda")
    assert torch.equal(cuda.gather_rows(half, idx), reference.gather_rows(half, idx))
    pos = torch.randperm(50, device="cuda")[:40].view(20, 2)
    assert torch.equal(cuda.combine(half, pos), reference.combine(half, pos))


@pytest.mark.gpu
@gpu
def test_cuda_sort_by_slot_with_many_slots_and_pairs():
    from moebalance.dispatch import cuda

    slot = torch.randint(0, 3000, (200_000, 8), device="cuda")
    for got, want in zip(cuda.sort_by_slot(slot, 3001), reference.sort_by_slot(slot, 3001)):
        assert torch.equal(got, want)


@pytest.mark.gpu
@gpu
def test_cuda_kernels_follow_the_current_stream():
    from moebalance.dispatch import cuda

    x = torch.randn(2048, 256, device="cuda")
    index = torch.randint(0, 2048, (8192,), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = cuda.gather_rows(x, index)
        back = cuda.combine(out, torch.arange(8192, device="cuda").view(2048, 4))
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(back, reference.combine(reference.gather_rows(x, index),
                                               torch.arange(8192, device="cuda").view(2048, 4)))
