"""``python -m moebalance``: the ``moebalance`` command (see :mod:`moebalance.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
