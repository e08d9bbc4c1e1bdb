"""The Hugging Face Trainer trains a transformers MoE model wrapped by moebalance on 4 gloo ranks.

A tiny Qwen3-MoE (8 experts, top-2, byte vocabulary) is made expert-parallel with mb.wrap over 4
CPU ranks of speed 1, 1, 0.5, 0.5 (3 expert slots each) and trained on the Python standard
library's source by transformers.Trainer; RebalanceTrainerCallback re-plans every --every steps
and migrates experts and their AdamW state live. At the end the model goes back to a plain
transformers checkpoint (mb.save_pretrained) that from_pretrained loads.

    python examples/hf_trainer_rebalance.py [--steps 40] [--every 10] [--family qwen3_moe]
    torchrun --standalone --nproc-per-node 4 examples/hf_trainer_rebalance.py

Needs transformers and accelerate (pip install 'moebalance[transformers]').
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

import moebalance as mb
from moebalance.lab.models import TextBatches, tiny_hf_moe
from moebalance.launch import launch, require_world_size

from _step_imbalance import StepImbalance

TOPOLOGY = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=[3, 3, 3, 3],
                                   node=[0, 0, 1, 1])
SEQ, BATCH = 64, 4


def worker(rank: int, world: int, steps: int, every: int, family: str, out: str | None) -> None:
    require_world_size(world, TOPOLOGY.num_devices)
    import transformers

    from moebalance.integrations.hf import RebalanceTrainerCallback

    # Rank 0's weights reach every rank inside wrap (a broadcast, as DDP does).
    model = mb.wrap(tiny_hf_moe(family, experts=8, seed=0), TOPOLOGY)
    rebalance = RebalanceTrainerCallback(TOPOLOGY, every=every)
    imbalance = StepImbalance(model, TOPOLOGY)

    class RecordImbalance(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):   # after the re-plan's on_step_end
            imbalance.record(rebalance.rebalancer)

    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=3e-3,
            report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0,
            train_sampling_strategy="sequential", average_tokens_across_devices=False)
        # Under torchrun the Trainer shards what it is handed (batch i to rank i % world): hand
        # it every rank's rows, step by step. Spawned, it does not: hand each rank its own.
        # Either way rank r trains on the same rows.
        ranks = range(world) if args.world_size > 1 else [rank]
        streams = [TextBatches(SEQ, BATCH, world, r, seed=0) for r in range(world)]
        rows = [{"input_ids": row, "labels": row} for step in range(steps) for r in ranks
                for row in streams[r](step)]
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                       callbacks=[rebalance, RecordImbalance()])
        if rank != 0:   # one rank prints the Trainer's summary
            trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        losses = []
        hook = model.register_forward_hook(lambda m, a, out: losses.append(float(out.loss)))
        trainer.train()
        hook.remove()
    loss = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
    dist.all_reduce(loss)
    if rank == 0:
        print(f"mean training loss over {steps} steps (all ranks): {float(loss) / world:.9f}")
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
    target = out or tempfile.mkdtemp(prefix="moebalance-hf-") if rank == 0 else None
    box = [target]
    dist.broadcast_object_list(box, group_src=0)
    mb.save_pretrained(model, box[0])
    if rank == 0:
        loaded = type(model).from_pretrained(box[0])
        print(f"saved a plain {type(loaded).__name__} to {box[0]} "
              f"({len(os.listdir(box[0]))} files, placement beside it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--every", type=int, default=10, help="re-plan every N steps (default 10)")
    parser.add_argument("--family", default="qwen3_moe",
                        help="mixtral, qwen2_moe, qwen3_moe (default), olmoe, deepseek_v3, gpt_oss")
    parser.add_argument("--quick", action="store_true", help="4 steps, re-plan every 2")
    parser.add_argument("--out", default=None,
                        help="folder for the final checkpoint (default: a temp dir)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.every = 4, 2
    if args.steps < 1 or args.every < 1:
        parser.error("--steps and --every must be >= 1")
    launch(worker, TOPOLOGY.num_devices, args=(args.steps, args.every, args.family, args.out),
           preload=("transformers.trainer",))


if __name__ == "__main__":
    main()
