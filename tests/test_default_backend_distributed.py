"""A process group made by ``init_process_group()`` with no backend named, as torchrun scripts
often make it: torch reports its backend as "undefined" and gives it one backend, for the
machine's accelerator or (here) gloo for the CPU. The library reads the backend per device type,
so such a group gets what a "gloo" group gets: p2p exchange, flags on the CPU, a transfer group
of its own for live migration (with its timeout). Cases of the live-rebalance suite run again
under it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import case_id, shared_spawn
from test_live_rebalance_distributed import (
    WORLD,
    failed_transfer_on_one_rank_keeps_old_placement_everywhere,
    global_norm_clipping_equals_single_process_clipping,
    grad_scaler_skips_on_every_rank_when_one_ranks_experts_overflow,
    rebalancer_plain_loop_drives_migrations_and_keeps_losses,
)

import moebalance as mb
from moebalance.collective_errors import backends, collective_device, flag_device, only_gloo
from moebalance.dispatch import Dispatcher
from moebalance.migrate import Migrator


def the_default_group_is_read_per_device_type():
    assert dist.get_backend() == "undefined"
    assert backends(None) == {"cpu": "gloo"} and only_gloo(None)
    assert flag_device(None) == torch.device("cpu") == collective_device(None)
    assert Dispatcher(None).exchange_for("cpu") == "p2p"
    transfer = Migrator(None).transfer_group()
    assert transfer is not dist.group.WORLD and isinstance(transfer, dist.ProcessGroupGloo)


def a_rank_that_recorded_nothing_snapshots_with_the_others():
    tracker = mb.LoadTracker(2, 4)
    if dist.get_rank() == 0:
        tracker.record(1, torch.tensor([[0, 3], [3, 2]]))
    loads = tracker.snapshot()      # the others contribute zeros, on the CPU as rank 0 does
    assert loads.tolist() == [[0.0] * 4, [1.0, 0.0, 1.0, 2.0]]


CASES = [
    the_default_group_is_read_per_device_type,
    a_rank_that_recorded_nothing_snapshots_with_the_others,
    rebalancer_plain_loop_drives_migrations_and_keeps_losses,
    failed_transfer_on_one_rank_keeps_old_placement_everywhere,
    grad_scaler_skips_on_every_rank_when_one_ranks_experts_overflow,
    global_norm_clipping_equals_single_process_clipping,
]

dist_results = shared_spawn(CASES, __name__, world_size=WORLD, timeout_s=240.0, backend=None)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_default_backend(dist_results, case):
    dist_results.check(case)
