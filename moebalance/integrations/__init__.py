"""Where the tracker, the planner, the migration and the layers meet: training-loop drivers.

* :class:`Rebalancer` (plain loop): ``rebalancer.step()`` after ``optimizer.step()``.
* :mod:`moebalance.integrations.lightning`: ``RebalanceCallback`` (Lightning 2.x).
* :mod:`moebalance.integrations.hf`: ``RebalanceTrainerCallback`` (transformers ``Trainer``).

Lightning and transformers are imported only by their own modules.
"""

from .loop import Rebalancer

__all__ = ["Rebalancer"]
