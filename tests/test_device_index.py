"""Placement-derived index tensors are copied to a device once and reused (no per-step copy), and
the CUDA sort's chunking terminates for any slot count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moebalance.device_index import DeviceIndex, to_device_async
from moebalance.dispatch import cuda
from moebalance.nn.grad_sync import HolderExchange


def test_device_index_copies_once_per_device():
    host = torch.tensor([3, 1, 2])
    index = DeviceIndex(host)
    first = index.on("cpu")
    assert torch.equal(first, host) and index.on(torch.device("cpu")) is first


def test_to_device_async_keeps_values():
    host = torch.arange(7)
    assert torch.equal(to_device_async(host, torch.device("cpu")), host)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_index_on_cuda_is_one_copy_without_a_sync():
    index = DeviceIndex(torch.arange(1000))
    index.on("cuda")                                      # the one copy, pinned, non-blocking
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = index.on("cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(again.cpu(), torch.arange(1000))


def test_holder_exchange_reuses_its_device_indices():
    phy2log = np.array([0, 1, 2, 0, 1, 3, 0, 2])
    device = np.array([0, 0, 0, 1, 1, 1, 2, 2])
    exchange = HolderExchange(phy2log, device, rank=1, tag=0)
    rows = exchange.rep_slots_on(torch.device("cpu"))
    assert rows.tolist() == exchange.rep_slots.tolist() == [0, 1]
    assert exchange.rep_slots_on(torch.device("cpu")) is rows


@pytest.mark.parametrize("n, num_slots", [(10, 4), (1 << 20, 64), (1 << 20, 1 << 16),
                                          (5000, (1 << 22) + 1), (3, 1 << 30)])
def test_sort_chunking_terminates_and_bounds_the_table(n, num_slots):
    chunk = cuda._sort_chunk(n, num_slots)
    chunks = -(-n // chunk)
    assert chunk >= cuda._MIN_SORT_CHUNK
    assert num_slots * chunks <= max(cuda._MAX_HIST_ENTRIES, num_slots)
