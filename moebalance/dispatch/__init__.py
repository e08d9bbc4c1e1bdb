"""Replica-aware token dispatch: routing from global counts, per-step re-split, kernels
(reference, Numba, CUDA), row exchanges and the Dispatcher.

See :mod:`moebalance.dispatch.dispatcher` for the data flow of one dispatch / combine.
"""

from .buffers import release_buffers
from .dispatcher import Dispatcher, DispatchHandle
from .kernels import kernels_for
from .routing import ReplicaTable, replica_flows, replica_table, replica_targets
from .shares import resplit_plan, resplit_shares, step_imbalance

__all__ = ["Dispatcher", "DispatchHandle", "ReplicaTable", "replica_table", "replica_targets",
           "replica_flows", "resplit_plan", "resplit_shares", "step_imbalance", "kernels_for",
           "release_buffers"]
