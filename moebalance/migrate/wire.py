"""What travels between ranks and how ranks agree: every point-to-point tag space of the
package, the migration's own transfer groups, and the one ranks-agree check.

Tag spaces. Point-to-point messages of one process group match by (peer, tag); four
subsystems send them, each in its own half-open range of tags, so that no message of one can
ever match a receive of another (:data:`TAG_SPACES`, checked disjoint by the tests):

* ``dispatch``: token rows, tag = the receiving rank's local slot (``< 2**24``);
* ``grad_sync``: replica gradients, ``2**24 + (layer tag * 16 + kind) * 2 + phase``;
* ``migration``: expert rows, ``2**26 + (migration % 1024) * 1024 * 64 + layer * 64 + kind``,
  unique per migration so that a message of an abandoned migration never matches a later one.
* ``transient``: transient copies' weights and gradients,
  ``2**27 + ((layer % 1024 * 2 + phase) * 4096 + copy) * 16 + kind``.

Agreement. :func:`same_everywhere` is the one check that every rank holds the same thing (a
placement, a migration plan): one all-reduce of two integers. The migration and the Rebalancer use
it. The dispatcher checks its step's agreement (row width, dtype, bad ids) inside the count
exchange it makes anyway, so a step pays no collective of its own for it; errors raised on some
ranks only travel through :mod:`moebalance.collective_errors`.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..collective_errors import flag_device

__all__ = ["TAG_SPACES", "tag_space", "same_everywhere", "group_key"]

DISPATCH_TAGS = 1 << 24
GRAD_SYNC_TAG_BASE = 1 << 24
GRAD_SYNC_TAG_KINDS = 16
MIGRATION_TAG_BASE = 1 << 26
MIGRATION_TAG_LAYERS = 1024
MIGRATION_TAG_KINDS = 64
MIGRATION_NUMBERS = 1024
TRANSIENT_TAG_BASE = 1 << 27
TRANSIENT_TAG_LAYERS = 1024
TRANSIENT_TAG_COPIES = 4096      # transient copies of one layer's step (ranks x slots)
TRANSIENT_TAG_KINDS = 16

# name -> [first, end) of its tags
TAG_SPACES = {
    "dispatch": (0, DISPATCH_TAGS),
    "grad_sync": (GRAD_SYNC_TAG_BASE, MIGRATION_TAG_BASE),
    "migration": (MIGRATION_TAG_BASE,
                  MIGRATION_TAG_BASE
                  + MIGRATION_NUMBERS * MIGRATION_TAG_LAYERS * MIGRATION_TAG_KINDS),
    "transient": (TRANSIENT_TAG_BASE,
                  TRANSIENT_TAG_BASE
                  + TRANSIENT_TAG_LAYERS * 2 * TRANSIENT_TAG_COPIES * TRANSIENT_TAG_KINDS),
}


def tag_space(name: str) -> range:
    """The tags subsystem ``name`` may use (a key of :data:`TAG_SPACES`)."""
    first, end = TAG_SPACES[name]
    return range(first, end)


def group_key(group) -> tuple:
    """The global ranks of ``group`` (None: the default group), a key for per-group caches."""
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def same_everywhere(text: str, group) -> bool:
    """Whether every rank of ``group`` passed the same ``text`` (collective: min == max of a
    62-bit digest, one all-reduce of two integers)."""
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=flag_device(group))
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    return int(both[0]) == digest and int(both[1]) == -digest
