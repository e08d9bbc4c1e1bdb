"""CUDA kernels of the dispatch (``csrc/dispatch.cu``), compiled at first use and run through CuPy.

The source ships inside the package (``moebalance._csrc``) and is compiled with NVRTC by
``cupy.RawModule`` once per device; CuPy adds the ``-arch`` of the current GPU. Kernels run on
torch's current CUDA stream (``cupy.cuda.ExternalStream``), tensors cross as raw device pointers
(checked against the kernels' parameter lists read from the source) and every output is
allocated by torch's caching allocator.

Same functions and results as :mod:`.reference`. Shapes and dtypes are checked on the host; index
*values* are not (that would sync the stream on every call): out-of-range expert ids route to
slot -1, and out-of-range slots or rows are skipped, leaving their outputs unspecified.

Importing this module never needs a GPU; calling a kernel without CuPy and a CUDA device raises
RuntimeError.

Legend: T tokens, K top-k, D hidden size, E experts, X most replicas, S slots, N = T*K pairs,
M rows of a gathered source, C chunks of the counting sort.
"""

from __future__ import annotations

import functools

import torch

from ..backends import has_cupy_gpu
from . import checks
from .cuda_source import COMPILE_OPTIONS, SOURCE_PACKAGE, CudaSource
from .kernel_signatures import Param
from .reference import compute_dtype

__all__ = ["route", "sort_by_slot", "gather_rows", "combine", "combine_weight_grad", "source",
           "signatures", "KERNEL_NAMES", "SOURCE_FILE", "SOURCE_PACKAGE", "COMPILE_OPTIONS"]

SOURCE_FILE = "dispatch.cu"
_SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16"}
KERNEL_NAMES = (
    "route_pairs", "slot_chunk_histogram", "slot_chunk_scatter",
    "gather_rows_w16", "gather_rows_w8", "gather_rows_w4", "gather_rows_w2",
    *(f"{kind}_{suffix}{vec}" for suffix in _SUFFIX.values()
      for kind in ("gather_rows_scaled", "combine") for vec in ("", "_vec")),
    *(f"combine_weight_grad_{suffix}" for suffix in _SUFFIX.values()),
)
_BLOCK = 256
_WARPS_PER_BLOCK = _BLOCK // 32
# Bound on the [S, C] per-chunk histogram of the counting sort (int64 entries).
_MAX_HIST_ENTRIES = 1 << 22
_MIN_SORT_CHUNK = 256

_SOURCE = CudaSource(SOURCE_FILE, probe=KERNEL_NAMES[0])


def source() -> str:
    """The CUDA C++ source of the dispatch kernels, as shipped with the package."""
    return _SOURCE.text()


def signatures() -> dict[str, tuple[Param, ...]]:
    """``{kernel: its parameters}`` read from :func:`source` (each launch is checked against it)."""
    return _SOURCE.signatures()


def _require_gpu() -> None:
    if not has_cupy_gpu():
        raise RuntimeError(
            "the CUDA dispatch kernels need CuPy and a visible CUDA GPU (pip install "
            "'moebalance[cupy]'); on this machine use the 'numba' or 'torch' dispatch backend "
            "(moebalance.force_backend('dispatch', 'torch'))")


def _on_cuda(**tensors: torch.Tensor | None) -> torch.device:
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; the CUDA kernels take CUDA tensors "
                             f"(move it with .cuda() or use the numba/torch backend)")
        device = device or t.device
    return device


def _launch(device: torch.device, name: str, grid: int, args: tuple) -> None:
    """Launch kernel ``name`` with ``grid`` blocks of _BLOCK threads on torch's current stream
    (arguments checked and packed by :meth:`CudaSource.launch`)."""
    _SOURCE.launch(device, name, grid, _BLOCK, args)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(device: torch.device, work_items: int, per_block: int, blocks_per_sm: int = 32) -> int:
    """Blocks for ``work_items``, ``per_block`` each; at most a few waves (kernels grid-stride)."""
    return min(-(-work_items // per_block), _sm_count(_index(device)) * blocks_per_sm)


def _vector_width(dtype: torch.dtype, dim: int, *tensors: torch.Tensor) -> int:
    """Elements per 16-byte access if every row of every tensor is 16-byte aligned, else 1."""
    size = torch.empty((), dtype=dtype).element_size()
    width = 16 // size
    aligned = dim % width == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)
    return width if aligned else 1


def route(topk_ids_TK: torch.Tensor, rank_TK: torch.Tensor, slots_EX: torch.Tensor,
          bounds_EX: torch.Tensor) -> torch.Tensor:
    """See :func:`.reference.route`. Returns slot_TK [T, K] int64 (expert ids are not checked)."""
    _require_gpu()
    checks.check_route(topk_ids_TK, rank_TK, slots_EX, bounds_EX)
    device = _on_cuda(topk_ids_TK=topk_ids_TK, rank_TK=rank_TK, slots_EX=slots_EX,
                      bounds_EX=bounds_EX)
    out = torch.empty(topk_ids_TK.shape, dtype=torch.int64, device=device)
    n = out.numel()
    if n:
        E, X = slots_EX.shape
        _launch(device, "route_pairs", _grid(device, n, _BLOCK),
                (topk_ids_TK.contiguous(), rank_TK.contiguous(), slots_EX.contiguous(),
                 bounds_EX.contiguous(), n, E, X, out))
    return out


def sort_by_slot(slot_TK: torch.Tensor,
                 num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`.reference.sort_by_slot`. Returns (order_N, pos_TK, counts_S), all int64.

    Deterministic: per-chunk histograms, an exclusive scan (torch.cumsum on the same stream) and
    a per-chunk stable scatter, one warp per chunk; no atomics.
    """
    _require_gpu()
    checks.check_sort_by_slot(slot_TK, num_slots)
    device = _on_cuda(slot_TK=slot_TK)
    n = slot_TK.numel()
    order = torch.empty(n, dtype=torch.int64, device=device)
    pos = torch.empty(slot_TK.shape, dtype=torch.int64, device=device)
    if n == 0:
        return order, pos, torch.zeros(num_slots, dtype=torch.int64, device=device)
    chunk = _sort_chunk(n, num_slots)
    chunks = -(-n // chunk)
    slot = slot_TK.contiguous()
    hist = torch.zeros(num_slots * chunks, dtype=torch.int64, device=device)
    grid = -(-chunks // _WARPS_PER_BLOCK)
    _launch(device, "slot_chunk_histogram", grid, (slot, n, num_slots, chunk, chunks, hist))
    counts = hist.view(num_slots, chunks).sum(dim=1)
    cursor = torch.cumsum(hist, dim=0) - hist
    _launch(device, "slot_chunk_scatter", grid,
            (slot, n, num_slots, chunk, chunks, cursor, order, pos))
    return order, pos, counts


def _sort_chunk(n: int, num_slots: int) -> int:
    """Pairs per chunk of the counting sort: the smallest power-of-two multiple of
    _MIN_SORT_CHUNK that keeps the [S, C] table within _MAX_HIST_ENTRIES, or one chunk of all
    ``n`` pairs when nothing does (S > 2**22: the table is then [S, 1], the counts themselves)."""
    chunk = _MIN_SORT_CHUNK
    while chunk < n and num_slots * -(-n // chunk) > _MAX_HIST_ENTRIES:
        chunk *= 2
    return chunk


def gather_rows(x_MD: torch.Tensor, index_N: torch.Tensor, scale_N: torch.Tensor | None = None,
                *, out: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`.reference.gather_rows`. Returns out_ND [N, D] in x_MD's dtype.

    One warp per row; without a scale rows move as raw 16-, 8-, 4- or 2-byte words, the widest
    that the row size and the pointers' alignment allow.
    """
    _require_gpu()
    checks.check_gather_rows(x_MD, index_N, scale_N)
    device = _on_cuda(x_MD=x_MD, index_N=index_N, scale_N=scale_N)
    shape = (index_N.shape[0], x_MD.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=x_MD.dtype, device=device)
    else:
        checks.check_out(out, shape, x_MD.dtype, device)
    n, dim = shape
    if n == 0 or dim == 0:
        return out
    x, index = x_MD.contiguous(), index_N.contiguous()
    grid = _grid(device, n, _WARPS_PER_BLOCK, blocks_per_sm=64)
    if scale_N is None:
        row_bytes = dim * x.element_size()
        word = next(w for w in (16, 8, 4, 2)
                    if row_bytes % w == 0 and x.data_ptr() % w == 0 and out.data_ptr() % w == 0)
        _launch(device, f"gather_rows_w{word}", grid,
                (x, index, out, n, row_bytes // word, x.shape[0]))
    else:
        scale = scale_N.to(compute_dtype(x.dtype)).contiguous()
        vec = "_vec" if _vector_width(x.dtype, dim, x, out) > 1 else ""
        _launch(device, f"gather_rows_scaled_{_SUFFIX[x.dtype]}{vec}", grid,
                (x, index, scale, out, n, dim, x.shape[0]))
    return out


def combine(y_ND: torch.Tensor, pos_TK: torch.Tensor, weights_TK: torch.Tensor | None = None,
            *, out: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`.reference.combine`. Returns out_TD [T, D] in y_ND's dtype.

    One block per token; each thread owns 16 bytes of the row when aligned and sums over K in
    the compute dtype.
    """
    _require_gpu()
    checks.check_combine(y_ND, pos_TK, weights_TK)
    device = _on_cuda(y_ND=y_ND, pos_TK=pos_TK, weights_TK=weights_TK)
    T, K = pos_TK.shape
    shape = (T, y_ND.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=y_ND.dtype, device=device)
    else:
        checks.check_out(out, shape, y_ND.dtype, device)
    dim = shape[1]
    if T == 0 or dim == 0:
        return out
    y, pos = y_ND.contiguous(), pos_TK.contiguous()
    w = None if weights_TK is None else weights_TK.to(compute_dtype(y.dtype)).contiguous()
    vec = _vector_width(y.dtype, dim, y, out)
    _launch(device, f"combine_{_SUFFIX[y.dtype]}{'_vec' if vec > 1 else ''}",
            _grid(device, T, 1, blocks_per_sm=16), (y, pos, w, out, T, K, dim, y.shape[0]))
    return out


def combine_weight_grad(grad_TD: torch.Tensor, y_ND: torch.Tensor,
                        pos_TK: torch.Tensor) -> torch.Tensor:
    """See :func:`.reference.combine_weight_grad`. Returns grad_w_TK [T, K] in the compute dtype.

    One warp per pair: lanes stride over D, then a shuffle reduction.
    """
    _require_gpu()
    checks.check_combine_weight_grad(grad_TD, y_ND, pos_TK)
    device = _on_cuda(grad_TD=grad_TD, y_ND=y_ND, pos_TK=pos_TK)
    out = torch.empty(pos_TK.shape, dtype=compute_dtype(y_ND.dtype), device=device)
    pairs = out.numel()
    if pairs == 0:
        return out
    if y_ND.shape[1] == 0:
        return out.zero_()
    _launch(device, f"combine_weight_grad_{_SUFFIX[y_ND.dtype]}",
            _grid(device, pairs, _WARPS_PER_BLOCK, blocks_per_sm=64),
            (grad_TD.contiguous(), y_ND.contiguous(), pos_TK.contiguous(), out, pairs,
             pos_TK.shape[1], y_ND.shape[1], y_ND.shape[0]))
    return out
