"""The step simulator: replays per-step router counts on a modelled cluster (``cluster``,
``stepmodel``, ``traces``) under a placement policy (``policies``: moebalance, EPLB, none),
and reports step time and balance per step (``run``, ``command``: ``moebalance simulate``)."""
