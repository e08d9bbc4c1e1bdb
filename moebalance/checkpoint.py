"""Former home of :mod:`moebalance.nn.checkpoint` (expert checkpoints by logical id); kept so
that existing ``import moebalance.checkpoint`` lines go on working."""

from .nn.checkpoint import expert_state_dict, load, load_expert_state_dict, save

__all__ = ["expert_state_dict", "load_expert_state_dict", "save", "load"]
