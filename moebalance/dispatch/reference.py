"""Plain torch reference of every dispatch kernel.

Each function here is the definition the Numba (``numba_kernels``) and CUDA (``cuda``) kernels must
reproduce; tests compare them on random inputs. Integer outputs are identical everywhere; float
outputs are identical where the arithmetic is (gather, combine), and equal up to summation order
where a reduction is involved (``combine_weight_grad``). The argument checks all backends share
live in :mod:`.checks`.

Legend: T tokens on this rank, K top-k, D hidden size, E logical experts, X most replicas of an
expert, S global slots, N = T*K routed pairs, pair index p = t*K + k, M rows of a gathered source.

Arithmetic: 16-bit inputs (bfloat16, float16) are computed in float32 and rounded once at the end;
float32 in float32; float64 in float64 (:func:`compute_dtype`). Scales and weights of any float
dtype are first converted to that compute dtype.
"""

from __future__ import annotations

import torch

from .checks import (
    check_combine,
    check_combine_weight_grad,
    check_expert_ids,
    check_gather_rows,
    check_index_values,
    check_out,
    check_route,
    check_slot_values,
    check_sort_by_slot,
)

__all__ = ["compute_dtype", "route", "sort_by_slot", "gather_rows", "combine",
           "combine_weight_grad"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic on ``dtype`` data runs in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- the kernels ------------------------------------------------------------------------------


def route(topk_ids_TK: torch.Tensor, rank_TK: torch.Tensor, slots_EX: torch.Tensor,
          bounds_EX: torch.Tensor) -> torch.Tensor:
    """Physical slot of every routed pair, from this rank's cumulative pairs per replica.

    Args:
        topk_ids_TK: [T, K] int64, logical expert of each pair.
        rank_TK: [T, K] int64, the pair's place among this rank's pairs of its expert, in pair
            order (0 for the first pair of expert e, 1 for the next, ...).
        slots_EX: [E, X] int64, physical slots of each expert's replicas (-1 padded).
        bounds_EX: [E, X] int64, cumulative pairs of each expert this rank sends to its replicas
            1..j (non-decreasing along j; see :mod:`.routing`).

    Returns:
        slot_TK: [T, K] int64, slots_EX[e, j] for the first j with rank_TK < bounds_EX[e, j]
        (the last column when there is none).
    """
    check_route(topk_ids_TK, rank_TK, slots_EX, bounds_EX)
    check_expert_ids(topk_ids_TK, slots_EX.shape[0])
    bounds = bounds_EX[topk_ids_TK]                        # [T, K, X]
    j = (rank_TK.unsqueeze(-1) >= bounds).sum(-1).clamp(max=slots_EX.shape[1] - 1)
    return slots_EX[topk_ids_TK, j]


def sort_by_slot(slot_TK: torch.Tensor,
                 num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable counting sort of the routed pairs by slot.

    Args:
        slot_TK: [T, K] int64, slot of each pair, in [0, num_slots).
        num_slots: S.

    Returns:
        order_N: [N] int64, pair index p at each sorted position (slots ascending, p ascending
            within a slot); pos_TK: [T, K] int64, sorted position of each pair (the inverse of
            order_N); counts_S: [S] int64, pairs per slot.
    """
    check_sort_by_slot(slot_TK, num_slots)
    check_slot_values(slot_TK, num_slots)
    flat = slot_TK.reshape(-1)
    order_N = torch.argsort(flat, stable=True)
    pos = torch.empty_like(order_N)
    pos[order_N] = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
    # not torch.bincount: on a GPU it reads the largest id on the host to size its output
    counts_S = torch.zeros(num_slots, dtype=torch.int64, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))
    return order_N, pos.view(slot_TK.shape), counts_S


def gather_rows(x_MD: torch.Tensor, index_N: torch.Tensor, scale_N: torch.Tensor | None = None,
                *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[i] = x[index[i]] (* scale[i] when given).

    Args:
        x_MD: [M, D] float, source rows.
        index_N: [N] int64, source row of each output row, in [0, M).
        scale_N: optional [N] float, factor of each output row.
        out: optional preallocated [N, D] result (x_MD's dtype, contiguous); reusing one saves
            the first-touch page faults of a fresh allocation, which on CPU cost as much as
            the copy.

    Returns:
        out_ND: [N, D] with x_MD's dtype.
    """
    check_gather_rows(x_MD, index_N, scale_N)
    if out is not None:
        check_out(out, (index_N.shape[0], x_MD.shape[1]), x_MD.dtype, x_MD.device)
    check_index_values(index_N, x_MD.shape[0])
    rows = x_MD.index_select(0, index_N)
    if scale_N is not None:
        ct = compute_dtype(x_MD.dtype)
        rows = (rows.to(ct) * scale_N.to(ct).unsqueeze(1)).to(x_MD.dtype)
    return rows if out is None else out.copy_(rows)


def combine(y_ND: torch.Tensor, pos_TK: torch.Tensor, weights_TK: torch.Tensor | None = None,
            *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[pos[t, k]], summed in k order from 0 (w = 1 when None).

    Args:
        y_ND: [N, D] float, rows in sorted order.
        pos_TK: [T, K] int64, row of y holding each pair, in [0, N).
        weights_TK: optional [T, K] float, weight of each pair.
        out: optional preallocated [T, D] result (y_ND's dtype, contiguous).

    Returns:
        out_TD: [T, D] with y_ND's dtype (accumulated in :func:`compute_dtype`).
    """
    check_combine(y_ND, pos_TK, weights_TK)
    if out is not None:
        check_out(out, (pos_TK.shape[0], y_ND.shape[1]), y_ND.dtype, y_ND.device)
    check_index_values(pos_TK.reshape(-1), y_ND.shape[0], "pos_TK")
    ct = compute_dtype(y_ND.dtype)
    T, K = pos_TK.shape
    acc = torch.zeros(T, y_ND.shape[1], dtype=ct, device=y_ND.device)
    w = None if weights_TK is None else weights_TK.to(ct)
    for k in range(K):
        rows = y_ND.index_select(0, pos_TK[:, k]).to(ct)
        acc = acc + (rows if w is None else w[:, k:k + 1] * rows)
    return acc.to(y_ND.dtype) if out is None else out.copy_(acc)


def combine_weight_grad(grad_TD: torch.Tensor, y_ND: torch.Tensor,
                        pos_TK: torch.Tensor) -> torch.Tensor:
    """grad_w[t, k] = dot(grad[t], y[pos[t, k]]): the gradient of :func:`combine` w.r.t. weights.

    Args:
        grad_TD: [T, D] float, gradient of combine's output.
        y_ND: [N, D] float (grad_TD's dtype), combine's input rows.
        pos_TK: [T, K] int64, row of y holding each pair.

    Returns:
        grad_w_TK: [T, K] in :func:`compute_dtype` (float32, or float64 for float64 inputs);
        cast it to the weights' dtype.
    """
    check_combine_weight_grad(grad_TD, y_ND, pos_TK)
    check_index_values(pos_TK.reshape(-1), y_ND.shape[0], "pos_TK")
    ct = compute_dtype(y_ND.dtype)
    T, K = pos_TK.shape
    rows = y_ND.index_select(0, pos_TK.reshape(-1)).to(ct).view(T, K, y_ND.shape[1])
    return torch.bmm(rows, grad_TD.to(ct).unsqueeze(-1)).squeeze(-1)
