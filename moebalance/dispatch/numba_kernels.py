"""Numba CPU kernels of the dispatch: the functions of :mod:`.reference`, same results, parallel.

Tensors pass zero-copy: contiguous CPU tensors are viewed with ``tensor.numpy()`` and outputs are
allocated by torch and filled in place. Numba has no 16-bit float type, so bfloat16/float16 inputs
of the float kernels run the torch reference (same results by definition).

Legend: T tokens, K top-k, D hidden size, E experts, X most replicas, S slots, N = T*K pairs,
M rows of a gathered source, C chunks of a parallel counting sort.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numba
import numpy as np
import torch
from numba import njit, prange

from . import checks, reference

__all__ = ["route", "sort_by_slot", "gather_rows", "combine", "combine_weight_grad"]

_NUMBA_FLOATS = (torch.float32, torch.float64)
# Below this many pairs per chunk, threads cost more than they save in the counting sort.
_MIN_PAIRS_PER_CHUNK = 1 << 14
# Below this many elements a kernel runs on the calling thread: waking workers costs more than
# it saves, and far more when several ranks share the cores (a descheduled worker stalls it).
_SERIAL_BELOW = 1 << 15


@contextmanager
def _threads_for(elements: int) -> Iterator[int]:
    """Run the enclosed kernel call on no more threads than torch's intra-op pool, and on one
    when ``elements`` is small; give that thread count; leave torch's count as it was.

    Numba's OpenMP threading layer shares the OpenMP runtime with torch: starting it (Numba's
    first thread query or parallel kernel) sets torch's thread count to Numba's, so a rank that
    torchrun (OMP_NUM_THREADS=1) or the user held to one thread would run torch on every core
    after its first dispatch, several times slower where ranks share the cores.
    """
    torch_threads = torch.get_num_threads()
    before = numba.get_num_threads()
    wanted = 1 if elements < _SERIAL_BELOW else min(before, torch_threads)
    if wanted != before:
        numba.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        if wanted != before:
            numba.set_num_threads(before)
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


# -- kernels (numpy in, numpy out; inputs already checked) ------------------------------------


@njit(parallel=True, cache=True)
def _route_kernel(ids_N, rank_N, slots_EX, bounds_EX, out_N):
    last = slots_EX.shape[1] - 1
    for p in prange(ids_N.shape[0]):
        e = ids_N[p]
        r = rank_N[p]
        j = 0
        while j < last and r >= bounds_EX[e, j]:
            j += 1
        out_N[p] = slots_EX[e, j]


@njit(parallel=True, cache=True)
def _sort_kernel(slot_N, num_slots, num_chunks, order_N, pos_N, counts_S):
    """Stable counting sort in three passes: per-chunk histograms, offsets, per-chunk scatter."""
    n = slot_N.shape[0]
    chunk = (n + num_chunks - 1) // num_chunks
    hist_CS = np.zeros((num_chunks, num_slots), dtype=np.int64)
    for c in prange(num_chunks):
        for p in range(c * chunk, min(n, (c + 1) * chunk)):
            hist_CS[c, slot_N[p]] += 1
    # start of (chunk c, slot s) = pairs in slots < s + pairs of slot s in chunks < c
    total = 0
    for s in range(num_slots):
        counts_S[s] = 0
        for c in range(num_chunks):
            h = hist_CS[c, s]
            hist_CS[c, s] = total
            total += h
            counts_S[s] += h
    for c in prange(num_chunks):
        cursor = hist_CS[c]
        for p in range(c * chunk, min(n, (c + 1) * chunk)):
            s = slot_N[p]
            q = cursor[s]
            cursor[s] = q + 1
            pos_N[p] = q
            order_N[q] = p


@njit(parallel=True, cache=True)
def _gather_kernel(x_MD, index_N, out_ND):
    D = x_MD.shape[1]
    for i in prange(index_N.shape[0]):
        src = x_MD[index_N[i]]
        dst = out_ND[i]
        for d in range(D):
            dst[d] = src[d]


@njit(parallel=True, cache=True)
def _gather_scaled_kernel(x_MD, index_N, scale_N, out_ND):
    D = x_MD.shape[1]
    for i in prange(index_N.shape[0]):
        src = x_MD[index_N[i]]
        dst = out_ND[i]
        a = scale_N[i]
        for d in range(D):
            dst[d] = src[d] * a


@njit(parallel=True, cache=True)
def _combine_kernel(y_ND, pos_TK, out_TD):
    T, K = pos_TK.shape
    D = y_ND.shape[1]
    for t in prange(T):
        dst = out_TD[t]
        for d in range(D):
            dst[d] = 0
        for k in range(K):
            src = y_ND[pos_TK[t, k]]
            for d in range(D):
                dst[d] = dst[d] + src[d]


@njit(parallel=True, cache=True)
def _combine_weighted_kernel(y_ND, pos_TK, w_TK, out_TD):
    T, K = pos_TK.shape
    D = y_ND.shape[1]
    for t in prange(T):
        dst = out_TD[t]
        for d in range(D):
            dst[d] = 0
        for k in range(K):
            src = y_ND[pos_TK[t, k]]
            w = w_TK[t, k]
            for d in range(D):
                dst[d] = dst[d] + w * src[d]


@njit(parallel=True, cache=True)
def _weight_grad_kernel(grad_TD, y_ND, pos_TK, out_TK):
    T, K = pos_TK.shape
    D = y_ND.shape[1]
    for t in prange(T):
        g = grad_TD[t]
        for k in range(K):
            src = y_ND[pos_TK[t, k]]
            acc = out_TK[t, k]  # a zero of the output dtype (out_TK comes zeroed)
            for d in range(D):
                acc += g[d] * src[d]
            out_TK[t, k] = acc


# -- torch-facing wrappers --------------------------------------------------------------------


def _cpu(x: torch.Tensor, name: str) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor (a contiguous copy only if it is strided)."""
    if x.device.type != "cpu":
        raise ValueError(f"{name} is on {x.device}; the Numba kernels run on CPU tensors only")
    return x.detach().contiguous().numpy()


def _output(out: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """``out`` checked against ``shape`` and ``like``'s dtype and device, or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype)
    checks.check_out(out, shape, like.dtype, like.device)
    return out


def route(topk_ids_TK: torch.Tensor, rank_TK: torch.Tensor, slots_EX: torch.Tensor,
          bounds_EX: torch.Tensor) -> torch.Tensor:
    """See :func:`.reference.route`. Returns slot_TK [T, K] int64."""
    checks.check_route(topk_ids_TK, rank_TK, slots_EX, bounds_EX)
    checks.check_expert_ids(topk_ids_TK, slots_EX.shape[0])
    out = torch.empty(topk_ids_TK.shape, dtype=torch.int64)
    if out.numel():
        with _threads_for(out.numel()):
            _route_kernel(_cpu(topk_ids_TK, "topk_ids_TK").reshape(-1),
                          _cpu(rank_TK, "rank_TK").reshape(-1), _cpu(slots_EX, "slots_EX"),
                          _cpu(bounds_EX, "bounds_EX"), out.detach().numpy().reshape(-1))
    return out


def sort_by_slot(slot_TK: torch.Tensor,
                 num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`.reference.sort_by_slot`. Returns (order_N, pos_TK, counts_S), all int64."""
    checks.check_sort_by_slot(slot_TK, num_slots)
    checks.check_slot_values(slot_TK, num_slots)
    n = slot_TK.numel()
    order = torch.empty(n, dtype=torch.int64)
    pos = torch.empty(slot_TK.shape, dtype=torch.int64)
    counts = torch.zeros(num_slots, dtype=torch.int64)
    if n:
        with _threads_for(n) as threads:
            chunks = max(1, min(threads, n // _MIN_PAIRS_PER_CHUNK))
            _sort_kernel(_cpu(slot_TK, "slot_TK").reshape(-1), num_slots, chunks, order.numpy(),
                         pos.numpy().reshape(-1), counts.numpy())
    return order, pos, counts


def gather_rows(x_MD: torch.Tensor, index_N: torch.Tensor, scale_N: torch.Tensor | None = None,
                *, out: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`.reference.gather_rows`. Returns out_ND [N, D] in x_MD's dtype."""
    checks.check_gather_rows(x_MD, index_N, scale_N)
    if x_MD.dtype not in _NUMBA_FLOATS:
        return reference.gather_rows(x_MD, index_N, scale_N, out=out)
    out = _output(out, (index_N.shape[0], x_MD.shape[1]), x_MD)
    checks.check_index_values(index_N, x_MD.shape[0])
    if out.numel():
        x, index = _cpu(x_MD, "x_MD"), _cpu(index_N, "index_N")
        with _threads_for(out.numel()):
            if scale_N is None:
                _gather_kernel(x, index, out.detach().numpy())
            else:
                scale = _cpu(scale_N.to(x_MD.dtype), "scale_N")
                _gather_scaled_kernel(x, index, scale, out.detach().numpy())
    return out


def combine(y_ND: torch.Tensor, pos_TK: torch.Tensor, weights_TK: torch.Tensor | None = None,
            *, out: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`.reference.combine`. Returns out_TD [T, D] in y_ND's dtype."""
    checks.check_combine(y_ND, pos_TK, weights_TK)
    if y_ND.dtype not in _NUMBA_FLOATS:
        return reference.combine(y_ND, pos_TK, weights_TK, out=out)
    out = _output(out, (pos_TK.shape[0], y_ND.shape[1]), y_ND)
    checks.check_index_values(pos_TK.reshape(-1), y_ND.shape[0], "pos_TK")
    if out.numel():
        y, pos = _cpu(y_ND, "y_ND"), _cpu(pos_TK, "pos_TK")
        with _threads_for(pos.size * y_ND.shape[1]):
            if weights_TK is None:
                _combine_kernel(y, pos, out.detach().numpy())
            else:
                _combine_weighted_kernel(y, pos, _cpu(weights_TK.to(y_ND.dtype), "weights_TK"),
                                         out.detach().numpy())
    return out


def combine_weight_grad(grad_TD: torch.Tensor, y_ND: torch.Tensor,
                        pos_TK: torch.Tensor) -> torch.Tensor:
    """See :func:`.reference.combine_weight_grad`. Returns grad_w_TK [T, K] in the compute dtype."""
    checks.check_combine_weight_grad(grad_TD, y_ND, pos_TK)
    if y_ND.dtype not in _NUMBA_FLOATS:
        return reference.combine_weight_grad(grad_TD, y_ND, pos_TK)
    checks.check_index_values(pos_TK.reshape(-1), y_ND.shape[0], "pos_TK")
    out = torch.zeros(pos_TK.shape, dtype=y_ND.dtype)
    if out.numel():
        with _threads_for(out.numel() * y_ND.shape[1]):
            _weight_grad_kernel(_cpu(grad_TD, "grad_TD"), _cpu(y_ND, "y_ND"),
                                _cpu(pos_TK, "pos_TK"), out.detach().numpy())
    return out
