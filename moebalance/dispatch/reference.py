"""Plain torch reference of every dispatch kernel, and the argument checks all backends share.

Each function here is the definition the Numba (``numba_kernels``) and CUDA (``cuda``) kernels must
reproduce; tests compare them on random inputs. Integer outputs are identical everywhere; float
outputs are identical where the arithmetic is (gather, combine), and equal up to summation order
where a reduction is involved (``combine_weight_grad``).

Legend: T tokens on this rank, K top-k, D hidden size, E logical experts, X most replicas of an
expert, S global slots, N = T*K routed pairs, pair index p = t*K + k, M rows of a gathered source.

Arithmetic: 16-bit inputs (bfloat16, float16) are computed in float32 and rounded once at the end;
float32 in float32; float64 in float64 (:func:`compute_dtype`). Scales and weights of any float
dtype are first converted to that compute dtype.

Value checks (expert ids, slots and row indices in range) run for CPU tensors only: reading a
device tensor's minimum and maximum on the host would stall every step. On an accelerator the
Dispatcher checks expert ids through its counts exchange, and the other indices come from these
kernels themselves.
"""

from __future__ import annotations

import torch

# Routing hash: u = ((i * HASH_MULTIPLIER) mod 2**32) >> 8, a Weyl sequence in [0, 2**24).
HASH_MULTIPLIER = 2654435761
HASH_BITS = 24
HASH_ONE = 1 << HASH_BITS

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

__all__ = [
    "HASH_MULTIPLIER", "HASH_BITS", "HASH_ONE", "compute_dtype", "hash24",
    "route", "sort_by_slot", "gather_rows", "combine", "combine_weight_grad",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic on ``dtype`` data runs in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- argument checks shared by every backend --------------------------------------------------


def _tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _int64(x, name: str, ndim: int, shape_doc: str) -> torch.Tensor:
    x = _tensor(x, name)
    if x.dtype != torch.int64:
        raise TypeError(f"{name} must be an int64 tensor {shape_doc}, got dtype {x.dtype}; "
                        f"convert with .long()")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {shape_doc}, got shape {tuple(x.shape)}")
    return x


def _floats(x, name: str, ndim: int, shape_doc: str) -> torch.Tensor:
    x = _tensor(x, name)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float32/float64/bfloat16/float16 tensor {shape_doc}, "
                        f"got dtype {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {shape_doc}, got shape {tuple(x.shape)}")
    return x


def _same_device(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}; "
                         f"move both to one device")


def check_route(topk_ids_TK, slots_EX, thresholds_EX, pair_offset) -> None:
    """Raise TypeError/ValueError unless the arguments of :func:`route` are well formed."""
    _int64(topk_ids_TK, "topk_ids_TK", 2, "[T, K]")
    _int64(slots_EX, "slots_EX", 2, "[E, X]")
    _int64(thresholds_EX, "thresholds_EX", 2, "[E, X]")
    if thresholds_EX.shape != slots_EX.shape:
        raise ValueError(f"thresholds_EX must have the shape of slots_EX {tuple(slots_EX.shape)}, "
                         f"got {tuple(thresholds_EX.shape)}; build both with routing_table()")
    if slots_EX.shape[0] < 1 or slots_EX.shape[1] < 1:
        raise ValueError(f"slots_EX must have at least one expert and one replica column, "
                         f"got shape {tuple(slots_EX.shape)}")
    _same_device("slots_EX", slots_EX, "topk_ids_TK", topk_ids_TK)
    _same_device("thresholds_EX", thresholds_EX, "topk_ids_TK", topk_ids_TK)
    if isinstance(pair_offset, bool) or not isinstance(pair_offset, int) or pair_offset < 0:
        raise ValueError(f"pair_offset must be a Python int >= 0, got {pair_offset!r}")


def _outside(values: torch.Tensor, upper: int) -> int | None:
    """A value of ``values`` outside [0, upper), or None; CPU tensors only: on an accelerator
    reading the range on the host would stall the step (see the module docstring)."""
    if values.numel() == 0 or values.device.type != "cpu":
        return None
    lo, hi = int(values.min()), int(values.max())
    if lo < 0:
        return lo
    return hi if hi >= upper else None


def check_expert_ids(topk_ids_TK: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError if an expert id lies outside [0, num_experts) (CPU tensors only)."""
    bad = _outside(topk_ids_TK, num_experts)
    if bad is not None:
        raise ValueError(f"topk_ids_TK holds expert id {bad}, outside [0, {num_experts}) of the "
                         f"routing table; route with the table of this layer")


def check_sort_by_slot(slot_TK, num_slots) -> None:
    """Raise TypeError/ValueError unless the arguments of :func:`sort_by_slot` are well formed."""
    _int64(slot_TK, "slot_TK", 2, "[T, K]")
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be a Python int >= 1, got {num_slots!r}")


def check_slot_values(slot_TK: torch.Tensor, num_slots: int) -> None:
    """Raise ValueError if a slot id lies outside [0, num_slots) (CPU tensors only)."""
    bad = _outside(slot_TK, num_slots)
    if bad is not None:
        raise ValueError(f"slot_TK holds slot {bad}, outside [0, num_slots={num_slots})")


def check_gather_rows(x_MD, index_N, scale_N) -> None:
    """Raise TypeError/ValueError unless the arguments of :func:`gather_rows` are well formed."""
    _floats(x_MD, "x_MD", 2, "[M, D]")
    _int64(index_N, "index_N", 1, "[N]")
    _same_device("index_N", index_N, "x_MD", x_MD)
    if scale_N is not None:
        _floats(scale_N, "scale_N", 1, "[N]")
        if scale_N.shape[0] != index_N.shape[0]:
            raise ValueError(f"scale_N must have shape [N]=({index_N.shape[0]},) like index_N, "
                             f"got {tuple(scale_N.shape)}")
        _same_device("scale_N", scale_N, "x_MD", x_MD)


def check_out(out, name_shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """Raise TypeError/ValueError unless ``out`` is a contiguous tensor of the given shape/dtype."""
    _tensor(out, "out")
    shape = tuple(name_shape)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be a {dtype} tensor of shape {shape} on {device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous; allocate it with torch.empty")


def check_index_values(index_N: torch.Tensor, num_rows: int, name: str = "index_N") -> None:
    """Raise ValueError if a row index lies outside [0, num_rows) (CPU tensors only)."""
    bad = _outside(index_N, num_rows)
    if bad is not None:
        raise ValueError(f"{name} holds row {bad}, outside [0, {num_rows})")


def check_combine(y_ND, pos_TK, weights_TK) -> None:
    """Raise TypeError/ValueError unless the arguments of :func:`combine` are well formed."""
    _floats(y_ND, "y_ND", 2, "[N, D]")
    _int64(pos_TK, "pos_TK", 2, "[T, K]")
    _same_device("pos_TK", pos_TK, "y_ND", y_ND)
    if weights_TK is not None:
        _floats(weights_TK, "weights_TK", 2, "[T, K]")
        if weights_TK.shape != pos_TK.shape:
            raise ValueError(f"weights_TK must have the shape of pos_TK {tuple(pos_TK.shape)}, "
                             f"got {tuple(weights_TK.shape)}")
        _same_device("weights_TK", weights_TK, "y_ND", y_ND)


def check_combine_weight_grad(grad_TD, y_ND, pos_TK) -> None:
    """Raise TypeError/ValueError unless the arguments of :func:`combine_weight_grad` are well formed."""
    _floats(grad_TD, "grad_TD", 2, "[T, D]")
    _floats(y_ND, "y_ND", 2, "[N, D]")
    _int64(pos_TK, "pos_TK", 2, "[T, K]")
    if grad_TD.dtype != y_ND.dtype:
        raise TypeError(f"grad_TD ({grad_TD.dtype}) and y_ND ({y_ND.dtype}) must share a dtype")
    if grad_TD.shape[0] != pos_TK.shape[0] or grad_TD.shape[1] != y_ND.shape[1]:
        raise ValueError(f"grad_TD must have shape [T, D]=({pos_TK.shape[0]}, {y_ND.shape[1]}), "
                         f"got {tuple(grad_TD.shape)}")
    _same_device("y_ND", y_ND, "grad_TD", grad_TD)
    _same_device("pos_TK", pos_TK, "grad_TD", grad_TD)


# -- the kernels ------------------------------------------------------------------------------


def hash24(i: torch.Tensor) -> torch.Tensor:
    """((i * HASH_MULTIPLIER) mod 2**32) >> 8 for int64 ``i >= 0``, without int64 overflow.

    The product is formed from 16-bit halves of ``i mod 2**32`` so every intermediate stays
    below 2**49.
    """
    low32 = i & 0xFFFFFFFF
    lo, hi = low32 & 0xFFFF, low32 >> 16
    prod = (lo * HASH_MULTIPLIER + (((hi * HASH_MULTIPLIER) & 0xFFFF) << 16)) & 0xFFFFFFFF
    return prod >> (32 - HASH_BITS)


def route(topk_ids_TK: torch.Tensor, slots_EX: torch.Tensor, thresholds_EX: torch.Tensor,
          pair_offset: int = 0) -> torch.Tensor:
    """Physical slot of every routed pair.

    Args:
        topk_ids_TK: [T, K] int64, logical expert of each pair.
        slots_EX: [E, X] int64, physical slots of each expert's replicas (-1 padded).
        thresholds_EX: [E, X] int64, cumulative thresholds in units of 2**-24 (see routing_table).
        pair_offset: added to the pair index p = t*K + k before hashing, so that pairs of
            different ranks/micro-batches draw different replicas.

    Returns:
        slot_TK: [T, K] int64, slots_EX[e, j] for the first j with hash24(pair_offset + p) <
        thresholds_EX[e, j].
    """
    check_route(topk_ids_TK, slots_EX, thresholds_EX, pair_offset)
    check_expert_ids(topk_ids_TK, slots_EX.shape[0])
    T, K = topk_ids_TK.shape
    p = torch.arange(T * K, dtype=torch.int64, device=topk_ids_TK.device).view(T, K)
    u = hash24(p + pair_offset)
    thr = thresholds_EX[topk_ids_TK]                      # [T, K, X]
    j = (u.unsqueeze(-1) >= thr).sum(-1)                  # thresholds are non-decreasing
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
    counts_S = torch.bincount(flat, minlength=num_slots)
    return order_N, pos.view(slot_TK.shape), counts_S


def gather_rows(x_MD: torch.Tensor, index_N: torch.Tensor, scale_N: torch.Tensor | None = None,
                *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[i] = x[index[i]] (* scale[i] when given).

    Args:
        x_MD: [M, D] float, source rows.
        index_N: [N] int64, source row of each output row, in [0, M).
        scale_N: optional [N] float, factor of each output row.
        out: optional preallocated [N, D] result (x_MD's dtype, contiguous); reusing one saves
            the first-touch page faults of a fresh allocation, which on CPU cost as much as the copy.

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
