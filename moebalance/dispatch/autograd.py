"""Autograd functions of the dispatch: permute + exchange, and exchange back + weighted combine.

Gradients flow to ``x`` (permute's backward is combine with unit weights), through the row
exchange (its backward is the reverse exchange, reorders included), and to ``topk_weights``
(``combine_weight_grad``). Every rank must run backward through the same exchanges: so in a group,
a backward's local work that fails on one rank is recorded
(:func:`moebalance.collective_errors.backward_attempt`) and replaced by zeros of the right shape,
the exchanges go on, and the group agrees on the failure when the backward ends.

Legend: T tokens, K top-k, D hidden size, N sorted rows, M slot-major rows.
"""

from __future__ import annotations

import torch

from ..collective_errors import backward_attempt
from .buffers import POOL
from .exchange import RowExchange

__all__ = ["DispatchRows", "CombineRows"]


def _local(rows: RowExchange, zeros, fn, *args):
    """``fn(*args)``; in a group, a failure is recorded for the end of the backward and
    ``zeros()`` (a tensor of the result's shape) stands in, so that the exchanges go on."""
    if rows.name == "local":
        return fn(*args)
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - agreed on when the backward ends
        backward_attempt(rows.group).fail(exc)
        return zeros()


class DispatchRows(torch.autograd.Function):
    """x rows to the slots of their pairs: permute and exchange in one (``rows.to_slot_major``).

    Backward: the gradient rows travel back to sorted order and each token sums its K rows.
    """

    @staticmethod
    def forward(ctx, x_TD, token_N, pos_TK, rows: RowExchange, kernels):
        ctx.save_for_backward(pos_TK)
        ctx.rows, ctx.kernels = rows, kernels
        return rows.to_slot_major(kernels, x_TD, token_N, None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_MD):
        (pos_TK,) = ctx.saved_tensors
        rows, kernels = ctx.rows, ctx.kernels
        grad_MD = _local(rows, lambda: grad_MD.new_zeros((rows.num_slot_major, grad_MD.shape[1])),
                         _contiguous, grad_MD, rows.num_slot_major)
        grad_ND = rows.to_sorted(kernels, grad_MD)
        grad_TD = _local(rows, lambda: grad_ND.new_zeros((pos_TK.shape[0], grad_ND.shape[1])),
                         kernels.combine, grad_ND, pos_TK, None)
        return grad_TD, None, None, None, None


class CombineRows(torch.autograd.Function):
    """Slot outputs back to their tokens (``rows.to_sorted``), then the weighted sum
    out[t] = sum_k w[t, k] * y[pos[t, k]]; gradients for y and w."""

    @staticmethod
    def forward(ctx, y_MD, weights_TK, pos_TK, token_N, order_N, rows: RowExchange, kernels):
        y_ND = rows.to_sorted(kernels, y_MD)
        # y_ND is kept only when the weights need a gradient (it is their dot product partner).
        ctx.save_for_backward(y_ND if ctx.needs_input_grad[1] else None, weights_TK, pos_TK,
                              token_N, order_N)
        ctx.rows, ctx.kernels = rows, kernels
        out = POOL.empty((pos_TK.shape[0], y_MD.shape[1]), y_MD.dtype, y_MD.device)
        return kernels.combine(y_ND, pos_TK, weights_TK, out=out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_TD):
        y_ND, weights_TK, pos_TK, token_N, order_N = ctx.saved_tensors
        rows, kernels = ctx.rows, ctx.kernels
        T = pos_TK.shape[0]
        grad_TD = _local(rows, lambda: grad_TD.new_zeros((T, grad_TD.shape[-1])), _contiguous,
                         grad_TD, T)
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            # Row i of y (sorted order) is pair order[i]: its gradient is w[pair] * grad[token].
            scale_N = _local(rows, lambda: weights_TK.new_zeros(order_N.shape),
                             lambda: weights_TK.reshape(-1).index_select(0, order_N))
            grad_y = rows.to_slot_major(kernels, grad_TD, token_N, scale_N)
        if ctx.needs_input_grad[1]:
            grad_w = _local(rows, lambda: torch.zeros_like(weights_TK), lambda: kernels
                            .combine_weight_grad(grad_TD, y_ND, pos_TK).to(weights_TK.dtype))
        return grad_y, grad_w, None, None, None, None, None


def _contiguous(grad: torch.Tensor, rows: int) -> torch.Tensor:
    """``grad`` made contiguous, after checking it has the ``rows`` rows the exchange moves."""
    if grad.dim() != 2 or grad.shape[0] != rows:
        raise ValueError(f"the gradient reaching the dispatch's backward has shape "
                         f"{tuple(grad.shape)}, expected [{rows}, D]")
    return grad.contiguous()
