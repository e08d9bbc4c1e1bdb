"""The step simulator: replays per-step router counts on a modelled cluster (``cluster``,
``stepmodel``, ``traces``) under a placement policy (``policies``: moebalance, EPLB, none;
``transient``: per-step copies of hot experts' weights),
and reports step time and balance per step (``run``, ``command``: ``moebalance simulate``)."""
