"""``python -m moebalance``: the ``moebalance`` command (see :mod:`moebalance.cli.main`)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
