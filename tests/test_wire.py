"""migrate/wire.py: the point-to-point tag spaces of dispatch, gradient sync and migration never
overlap, and each subsystem's tags stay inside its own space."""

import itertools

import numpy as np
import pytest

from moebalance.migrate import wire
from moebalance.nn.grad_sync import HolderExchange


def test_tag_spaces_are_disjoint_and_non_empty():
    spaces = sorted(wire.TAG_SPACES.values())
    assert all(first < end for first, end in spaces)
    for (_, end_a), (first_b, _) in itertools.pairwise(spaces):
        assert end_a <= first_b, wire.TAG_SPACES


def test_every_tag_fits_a_signed_32_bit_int():
    # gloo and NCCL take the tag as an int
    assert max(end for _, end in wire.TAG_SPACES.values()) <= 2**31


def test_gradient_tags_stay_in_their_space():
    phy2log = np.array([0, 1, 0, 1])
    slot_device = np.array([0, 0, 1, 1])
    exchange = HolderExchange(phy2log, slot_device, rank=0, tag=3)
    tags = [exchange._tag(kind, phase) for kind in range(wire.GRAD_SYNC_TAG_KINDS)
            for phase in (0, 1)]
    assert all(t in wire.tag_space("grad_sync") for t in tags)
    with pytest.raises(ValueError, match="tag space"):
        HolderExchange(phy2log, slot_device, rank=0, tag=10**7)


def test_migration_tags_stay_in_their_space():
    last = (wire.MIGRATION_TAG_BASE
            + (wire.MIGRATION_NUMBERS - 1) * wire.MIGRATION_TAG_LAYERS * wire.MIGRATION_TAG_KINDS
            + (wire.MIGRATION_TAG_LAYERS - 1) * wire.MIGRATION_TAG_KINDS
            + wire.MIGRATION_TAG_KINDS - 1)
    assert wire.MIGRATION_TAG_BASE in wire.tag_space("migration")
    assert last in wire.tag_space("migration")
