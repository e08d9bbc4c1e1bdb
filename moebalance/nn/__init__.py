"""The expert-parallel layer: ``moe`` (ExpertParallelMoE, DenseMoE, router, experts), ``slots``
(slot storage, commit before forward, apply_placement), ``grad_sync`` (holder-only reduction,
global clipping), ``checkpoint`` (experts by logical id)."""

from .moe import (
    DenseMoE,
    ExpertParallelMoE,
    SlotExperts,
    TopKRouter,
    apply_placement,
    clip_grad_norm_,
    current_placement,
    moe_layers,
    reduce_replica_gradients,
)

__all__ = ["TopKRouter", "SlotExperts", "DenseMoE", "ExpertParallelMoE", "reduce_replica_gradients",
           "apply_placement", "current_placement", "moe_layers", "clip_grad_norm_"]
