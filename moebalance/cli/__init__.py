"""The ``moebalance`` command: ``args`` (parser, errors, shared flag sets) and ``main`` (commands)."""
