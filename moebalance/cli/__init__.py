"""The ``moebalance`` command: ``args`` (parser, errors, shared flag sets), ``main`` (commands)."""
