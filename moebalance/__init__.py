"""moebalance: keep the experts of a Mixture-of-Experts model evenly loaded across unlike GPUs."""

from .backends import backends, force_backend, using_backend
from .metrics import balancedness, imbalance, summary_imbalance
from .placement import Placement
from .topology import Device, Topology
from .tracker import LoadTracker
from .dispatch import Dispatcher, step_imbalance
from .nn import ExpertParallelMoE
from .speeds import SpeedTracker
from .nn.slots import (apply_placement, clip_grad_norm_, current_placement,
                           reduce_replica_gradients)
from .migrate import MigrationError, plan_migration
from .collective_errors import GroupError
from .frameworks import exclude_experts_from_ddp

__version__ = "0.1.0"

__all__ = [
    "Device", "Topology", "Placement",
    "imbalance", "balancedness", "summary_imbalance",
    "backends", "force_backend", "using_backend", "warm_up",
    "LoadTracker", "attach", "SpeedTracker",
    "Dispatcher", "ExpertParallelMoE", "apply_placement", "current_placement",
    "reduce_replica_gradients", "clip_grad_norm_", "plan_migration", "MigrationError",
    "GroupError",
    "exclude_experts_from_ddp",
    "__version__",
]

from .planner import plan, rebalance_experts  # noqa: E402  (after the data types they return)
from .warmup import warm_up  # noqa: E402  (top floor: drives the planner and nn)
from .integrations import (Rebalancer, attach, from_pretrained, save_pretrained,  # noqa: E402
                           unwrap, wrap)
from . import checkpoint  # noqa: E402,F401  (the old path; nn.checkpoint is the module)
from .planner.elastic import replan_onto  # noqa: E402

__all__ += ["plan", "rebalance_experts", "step_imbalance", "Rebalancer", "wrap", "unwrap",
            "save_pretrained", "from_pretrained",
            "checkpoint", "replan_onto"]
