"""Autograd functions of the dispatch: permute + exchange, and exchange back + weighted combine.

Gradients flow to ``x`` (permute's backward is combine with unit weights), through the row
exchange (its backward is the reverse exchange, reorders included), and to ``topk_weights``
(``combine_weight_grad``). Every rank must run backward through the same exchanges.

Legend: T tokens, K top-k, D hidden size, N sorted rows, M slot-major rows.
"""

from __future__ import annotations

import torch

from .buffers import POOL
from .exchange import RowExchange

__all__ = ["DispatchRows", "CombineRows"]


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
        grad_ND = ctx.rows.to_sorted(ctx.kernels, grad_MD.contiguous())
        return ctx.kernels.combine(grad_ND, pos_TK, None), None, None, None, None


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
        kernels = ctx.kernels
        grad_TD = grad_TD.contiguous()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            # Row i of y (sorted order) is pair order[i]: its gradient is w[pair] * grad[token].
            scale_N = weights_TK.reshape(-1).index_select(0, order_N)
            grad_y = ctx.rows.to_slot_major(kernels, grad_TD, token_N, scale_N)
        if ctx.needs_input_grad[1]:
            grad_w = kernels.combine_weight_grad(grad_TD, y_ND, pos_TK).to(weights_TK.dtype)
        return grad_y, grad_w, None, None, None, None, None
