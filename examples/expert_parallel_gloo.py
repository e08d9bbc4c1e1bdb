"""End to end on one machine: an expert-parallel MoE layer on 4 gloo ranks of unlike speed.

Each rank trains the same ExpertParallelMoE layer on its own tokens for a few steps while a
LoadTracker records the router's choices; then the loads are summed over the ranks, a new
placement is planned for devices of speed 1, 1, 0.5, 0.5 (moving at most 4 experts), and every
rank checks that it planned the identical placement.

    python examples/expert_parallel_gloo.py [--steps 20]                  # spawns 4 ranks itself
    torchrun --standalone --nproc-per-node 4 examples/expert_parallel_gloo.py [--steps 20]

:func:`moebalance.launch.launch` tells the two apart: under torchrun each process is one rank
and joins the group from the environment torchrun sets; run directly, it spawns the ranks.
Moving weights into the new placement while training goes on is not part of this example.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist

import moebalance as mb
from moebalance.launch import launch, require_world_size

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 32, 64, 8, 2, 256
TOPOLOGY = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=[3, 3, 3, 3],
                                   node=[0, 0, 1, 1])


def worker(rank: int, world_size: int, steps: int) -> None:
    require_world_size(world_size, TOPOLOGY.num_devices)
    # First placement from a guess (uniform loads); every rank computes the same one.
    placement = mb.plan(np.ones((1, EXPERTS)), TOPOLOGY)
    moe = mb.ExpertParallelMoE(HIDDEN, FFN, EXPERTS, TOP_K, placement, seed=0,
                               nodes=TOPOLOGY.node)   # keep tokens on their node
    tracker = mb.attach(moe)
    optimizer = torch.optim.AdamW(moe.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    # Tokens drawn around a few directions, so the router learns uneven preferences.
    centres = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(7)) * 3
    losses = []
    for _ in range(steps):
        x = centres[torch.randint(0, 3, (TOKENS,), generator=gen)]
        x = x + torch.randn(TOKENS, HIDDEN, generator=gen)
        loss = (moe(x) - x.flip(1)).pow(2).mean()
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        moe.reduce_replica_gradients()   # replicas of an expert stay identical
        optimizer.step()
        tracker.step()
    loads = tracker.snapshot()           # [1, E], summed over the ranks
    new = mb.plan(loads, TOPOLOGY, previous=placement, max_moves=4)
    digest = torch.tensor(new.phy2log, dtype=torch.int64)
    agreed = [torch.zeros_like(digest) for _ in range(world_size)]
    dist.all_gather(agreed, digest)
    assert all(torch.equal(a, digest) for a in agreed), "ranks planned different placements"
    mean = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
    dist.all_reduce(mean)
    if rank == 0:
        print(f"loss after {steps} steps: {loss.item():.4f}")
        print(f"mean training loss over {steps} steps (all ranks): {float(mean) / world_size:.9f}")
        print(f"tokens per expert: {loads[0].astype(int).tolist()}")
        print(f"imbalance before {mb.imbalance(loads, placement, TOPOLOGY)[0]:.3f}, "
              f"after {mb.imbalance(loads, new, TOPOLOGY)[0]:.3f}, "
              f"moves {new.moves_from(placement)}")
        for g in range(TOPOLOGY.num_devices):
            slots = TOPOLOGY.device_slots(g)
            print(f"  device {g} (speed {TOPOLOGY.speed[g]}): experts "
                  f"{new.phy2log[0, slots].tolist()} shares "
                  f"{np.round(new.share[0, slots], 2).tolist()}")
        if (new.share[0] == 0).any():
            print("  share 0.0: that replica holds its expert but the plan routes none of the "
                  "expert's tokens to it (its other replicas take them all); it stays in sync "
                  "and a later plan may give it tokens without moving weights")
        if new.moves_from(placement) == 0 and not np.array_equal(new.share, placement.share):
            print("  0 moves: no expert moved; the plan re-weighted the token shares of the "
                  "replicated experts, which is where the balance changed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--quick", action="store_true", help="3 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = 3
    launch(worker, TOPOLOGY.num_devices, args=(args.steps,))


if __name__ == "__main__":
    main()
