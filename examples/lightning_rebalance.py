"""A transformers MoE model, wrapped by moebalance, trained by Lightning on 4 gloo ranks.

A tiny Mixtral (8 experts, top-2, byte vocabulary) is made expert-parallel with mb.wrap over 4
CPU ranks of speed 1, 1, 0.5, 0.5 (3 expert slots each) and trained on the Python standard
library's source by L.Trainer(devices=4, strategy="ddp"), the way Lightning users write it:
Lightning's DDP averages the dense part and its DistributedSampler shards the rows, while
RebalanceCallback keeps the expert slots out of that DDP, re-plans every --every steps, migrates
experts and their AdamW state live, and clips by the global gradient norm. Spawned, each rank
sets LOCAL_RANK so Lightning joins the existing ranks (torchrun sets it itself).

    python examples/lightning_rebalance.py [--steps 40] [--every 10] [--family mixtral]
    torchrun --standalone --nproc-per-node 4 examples/lightning_rebalance.py

Needs Lightning 2.x (pip install 'moebalance[lightning]') and transformers.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import moebalance as mb
from moebalance.lab.models import TextBatches, tiny_hf_moe
from moebalance.launch import launch, require_world_size, under_torchrun

from _step_imbalance import StepImbalance

TOPOLOGY = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=[3, 3, 3, 3],
                                   node=[0, 0, 1, 1])
SEQ, BATCH = 64, 4


def worker(rank: int, world: int, steps: int, every: int, family: str) -> None:
    require_world_size(world, TOPOLOGY.num_devices)
    import lightning as L

    from moebalance.integrations.lightning import RebalanceCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = mb.wrap(tiny_hf_moe(family, experts=8, seed=0), TOPOLOGY)
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    if not under_torchrun():
        # Lightning starts no processes when LOCAL_RANK is set (torchrun sets it): these exist.
        os.environ.setdefault("LOCAL_RANK", str(rank))
        os.environ.setdefault("NODE_RANK", "0")
    module = Module()
    rebalance = RebalanceCallback(TOPOLOGY, every=every)
    imbalance = StepImbalance(module, TOPOLOGY)

    class RecordImbalance(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            imbalance.record(rebalance.rebalancer)     # after the re-plan (callbacks in order)

    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0,
                        callbacks=[rebalance, RecordImbalance()])
    # A DistributedSampler (unshuffled: the one Lightning would install shuffles) hands row i to
    # rank i % world: interleave the ranks' rows so that rank r trains on stream r.
    streams = [TextBatches(SEQ, BATCH, world, r, seed=0) for r in range(world)]
    rows = []
    for step in range(steps):
        batches = [stream(step) for stream in streams]
        rows += [batches[r][i] for i in range(BATCH) for r in range(world)]
    sampler = torch.utils.data.DistributedSampler(rows, shuffle=False)
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=BATCH, sampler=sampler))
    summary = torch.tensor([module.losses[0], module.losses[-1],
                            sum(module.losses) / len(module.losses)], dtype=torch.float64)
    dist.all_reduce(summary)
    if rank == 0:
        print(f"loss (mean over ranks): first step {float(summary[0]) / world:.3f}, "
              f"last step {float(summary[1]) / world:.3f}")
        print(f"mean training loss over {steps} steps (all ranks): {float(summary[2]) / world:.9f}")
        for r in rebalance.rebalancer.history:
            print(f"step {r['step']:4d} re-plan: imbalance {r['imbalance_before']:.3f} -> "
                  f"{r['imbalance_after']:.3f} on the window's mean, "
                  f"{r['step_imbalance_before']:.3f} -> {r['step_imbalance_after']:.3f} per step, "
                  f"{r['moves']} moves, {r['bytes'] / 1e6:.2f} MB, "
                  f"migration {r['migration_s'] or 0:.3f} s"
                  + (" (no expert moved: the tokens of replicated experts were re-split between "
                     "their replicas)" if r["moves"] == 0
                     and r["imbalance_after"] < r["imbalance_before"] else ""))
        print(imbalance.bought())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--every", type=int, default=10, help="re-plan every N steps (default 10)")
    parser.add_argument("--family", default="mixtral",
                        help="mixtral (default), qwen2_moe, qwen3_moe, olmoe, deepseek_v3, gpt_oss")
    parser.add_argument("--quick", action="store_true", help="4 steps, re-plan every 2")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.every = 4, 2
    if args.steps < 1 or args.every < 1:
        parser.error("--steps and --every must be >= 1")
    launch(worker, TOPOLOGY.num_devices, args=(args.steps, args.every, args.family),
           preload=("lightning",))


if __name__ == "__main__":
    main()
