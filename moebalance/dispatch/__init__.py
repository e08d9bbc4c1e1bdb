"""Replica-aware token dispatch: routing tables, kernels (reference, Numba, CUDA) and the Dispatcher.

See :mod:`moebalance.dispatch.dispatcher` for the data flow of one dispatch / combine.
"""

from .dispatcher import RANK_PAIR_STRIDE, DispatchHandle, Dispatcher, release_buffers
from .kernels import kernels_for
from .routing import RoutingTable, routing_table

__all__ = ["Dispatcher", "DispatchHandle", "RANK_PAIR_STRIDE", "RoutingTable", "routing_table",
           "kernels_for", "release_buffers"]
