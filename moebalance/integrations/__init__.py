"""Where the tracker, the planner, the migration and the layers meet: training-loop drivers.

* :func:`attach` / :func:`find_routers` (:mod:`.routers`): the routers of a model, hooked to a
  LoadTracker.
* :class:`Rebalancer` (plain loop): ``rebalancer.step()`` after ``optimizer.step()``.
* :func:`wrap` / :func:`unwrap` / :func:`unwrap_state_dict` / :func:`save_pretrained`:
  transformers 5.x MoE models made expert-parallel, and back to their own layout;
  :func:`from_pretrained` loads a checkpoint expert-parallel, each rank reading only its own
  experts. (The name ``moebalance.integrations.wrap`` is the function; its module is reached
  through importlib.)
* :mod:`moebalance.integrations.lightning`: ``RebalanceCallback`` (Lightning 2.x).
* :mod:`moebalance.integrations.hf`: ``RebalanceTrainerCallback`` (transformers ``Trainer``).

Lightning and transformers are imported only by their own modules.
"""

from .loop import Rebalancer
from .pretrained import from_pretrained
from .routers import attach, attached_tracker, find_routers
from .wrap import save_pretrained, unwrap, unwrap_state_dict, wrap

__all__ = ["attach", "attached_tracker", "find_routers", "Rebalancer", "wrap", "unwrap",
           "unwrap_state_dict", "save_pretrained", "from_pretrained"]
