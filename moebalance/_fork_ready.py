"""Imported last by the fork server that gloo ranks start from (see :mod:`moebalance.launch`).

What the server imported (torch, the script, transformers) lives as long as every rank: frozen out
of the collector's scans here, before the fork, its pages stay shared. Frozen in each rank
instead, every rank would write to every object's header and so copy all of them.
"""

import gc

gc.collect()
gc.freeze()
