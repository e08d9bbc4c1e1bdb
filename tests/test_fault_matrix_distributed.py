"""DESIGN invariant 10: one rank's error is every rank's error, and the next good step works.

Every fault of :mod:`moebalance.lab.bench.faults` strikes rank 1 of 4 gloo ranks, all cases in
one spawn (the runner ``moebalance bench faults`` uses, at its small size), with a collective
timeout of 20 s: a fault that left the other ranks waiting would fail its case in seconds.
"""

from __future__ import annotations

import re

import pytest

from moebalance.lab.bench.faults import CASES, FAULTY, run_matrix

# A raise that every rank sees this long after the common start is a wait, not a carried error.
SECONDS = 10.0


@pytest.fixture(scope="module")
def matrix():
    return {row["fault"]: row for row in run_matrix(ranks=4, timeout_s=20.0)["rows"]}


def _explain(row) -> str:
    lines = [f"{row['fault']} ({row['where']}); spawn: {row['spawn_error']}"]
    for rank, entry in enumerate(row["per_rank"]):
        lines.append(f"rank {rank}: {entry}")
    return "\n".join(lines)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", [name for name, _, _ in CASES])
def test_one_ranks_fault_raises_the_same_error_on_every_rank(matrix, fault):
    row = matrix[fault]
    why = _explain(row)
    assert row["all_raised"], why
    assert row["same_type"] and row["same_text"], why
    assert row["library"], why                       # a GroupError (MigrationError is one)
    assert row["names_faulty"], why                  # it names the rank that failed
    assert re.search(rf"rank\(s\) \[{FAULTY}\]|\(rank {FAULTY}: ", row["message"]), why
    assert row["seconds"] < SECONDS, why
    assert row["next_ok"], why


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_error_keeps_the_original_message(matrix):
    """The faulty rank's own words reach every rank."""
    assert "expected m1 and m2 to have the same dtype" in \
        matrix["float32 rows into a float64 layer"]["message"]
    assert "the router's pre-hook failed" in matrix["router raises"]["message"]
    assert "expert ids outside [0, 8)" in matrix["router ids out of range"]["message"]
    assert "y_MD must be a float tensor" in matrix["expert output one row short"]["message"]
    assert "(rank by rank: [8, 9, 8, 8])" in matrix["tracker of another shape"]["message"]
    assert matrix["tracker of another shape"]["per_rank"][0]["ranks"] == [FAULTY]


def _lone_forward(rank: int, store: str, queue, done) -> None:
    """Rank 0 runs an expert-parallel forward that rank 1 never joins (a group with a 2 s
    timeout); rank 0 reports what it raised, while rank 1 stays up (a rank that left would
    close the connection instead). Neither tears the group down: rank 0's last collective
    failed. ``queue`` is a SimpleQueue: its put is written before ``os._exit`` (a Queue's
    feeder thread could still hold it)."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    import moebalance as mb

    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=2))
        if rank == 0:
            placement = mb.plan(torch.ones(1, 4), mb.Topology.uniform(num_devices=2,
                                                                      slots_per_device=2))
            layer = mb.ExpertParallelMoE(8, 16, 4, 2, placement, seed=0)
            layer(torch.randn(3, 8))
            queue.put("no error")
        else:
            done.wait(timeout=60)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        queue.put(f"{type(exc).__name__} on rank {rank}: {exc}")
    finally:
        if rank == 0:
            done.set()
    os._exit(0)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_forward_on_one_rank_alone_says_every_rank_must_run_it(tmp_path):
    import time

    import torch.multiprocessing as mp

    # Forked from the fork server the shared ranks use (torch imported there once), or one
    # this starts when no group ran before it.
    ctx = mp.get_context("forkserver")
    queue, done = ctx.SimpleQueue(), ctx.Event()
    procs = [ctx.Process(target=_lone_forward, args=(rank, str(tmp_path / "store"), queue, done))
             for rank in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 90
    while queue.empty() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not queue.empty(), f"no rank reported; exit codes {[p.exitcode for p in procs]}"
    message = queue.get()
    for p in procs:
        p.join(timeout=30)
    assert "did not run this forward" in message, message
    assert "every rank" in message.lower(), message
