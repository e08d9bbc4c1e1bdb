"""The expert-parallel layer: ``moe`` (ExpertParallelMoE, DenseMoE, router, experts), ``slots``
(slot storage, commit before forward, apply_placement), ``grad_sync`` (holder-only reduction,
global clipping), ``checkpoint`` (experts by logical id)."""

# the public names of the layer, re-exported so that ``moebalance.nn.ExpertParallelMoE`` works
from .moe import *  # noqa: F403
from .moe import __all__  # noqa: F401
