"""moebalance: keep the experts of a Mixture-of-Experts model evenly loaded across unlike GPUs."""

from .backends import backends, force_backend, using_backend
from .metrics import balancedness, imbalance, summary_imbalance
from .placement import Placement
from .topology import Device, Topology
from .tracker import LoadTracker, attach

__version__ = "0.1.0"

__all__ = [
    "Device", "Topology", "Placement",
    "imbalance", "balancedness", "summary_imbalance",
    "backends", "force_backend", "using_backend",
    "LoadTracker", "attach",
    "__version__",
]

from .planner import plan  # noqa: E402  (after the data types it returns)

__all__ += ["plan"]
